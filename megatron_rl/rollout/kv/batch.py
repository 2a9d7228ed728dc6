"""The per-forward batch: what one forward through the KV cache covers, made by the cache from its
bookkeeping (`prefill_batch`, `decode_batch`) and read by the attention (attention.py) and the
route recorder (route_rows.py). nano-vllm's `Context`, passed explicitly instead of kept in a
global: nothing of a forward stays in the cache after it.

- `PrefillBatch`: fresh sequences (`slots`), row b writing its first `new[b]` positions (S =
  max(new): padding positions past a row's tokens are never attended to by a real query, causal
  with right padding). Attention is causal over the new keys alone; `store` says where they go.
- `DecodeBatch`: one new token per row, at position `pos_B[b]` of sequence `slot_B[b]`. These are
  views of the decode step's static input buffer (rollout/decode_step.py), and everything derived
  from them is computed on the device inside the forward, so a captured CUDA graph replays it.
  `L` bounds the keys the torch path reads (> every position; a captured graph passes max_len, as it
  has one shape); `read` says where each row's keys are.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from megatron_rl.rollout.kv.route_rows import DecodeRows, PrefillRows


class KeyStore(Protocol):
    def store(self, K: torch.Tensor, V: torch.Tensor, k_BGSC: torch.Tensor, v_BGSC: torch.Tensor) -> None:
        """A prefill's new keys and values into one layer's K and V."""


class KeyRead(Protocol):
    def gather(self, K: torch.Tensor, V: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's first L keys and values, [B, G, L, C] (the torch path)."""

    def kernel(self, kernel: Callable, q_BHC: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
               slot_B: torch.Tensor, len_B: torch.Tensor) -> torch.Tensor:
        """The decode kernel over each row's `len_B` keys where the cache holds them."""


@dataclass(frozen=True)
class PrefillBatch:
    slots: list[int]
    new: list[int]
    S: int
    store: KeyStore
    rows: PrefillRows

    def positions(self, device: torch.device) -> torch.Tensor:
        """The queries' positions [B, S]."""
        return torch.arange(self.S, device=device).expand(len(self.slots), self.S)

    def attend(self, attention, layer: int, q_BHSC, k_BGSC, v_BGSC) -> torch.Tensor:
        return attention.prefill(layer, self, q_BHSC, k_BGSC, v_BGSC)


@dataclass(frozen=True)
class DecodeBatch:
    slot_B: torch.Tensor
    pos_B: torch.Tensor
    L: int
    write_BG: torch.Tensor  # where each row's new key goes, per KV group: rows of K viewed [-1, C]
    read: KeyRead
    zero: torch.Tensor  # the cache dtype's zero
    rows: DecodeRows

    @functools.cached_property
    def mask_B11L(self) -> torch.Tensor:
        """The torch path's additive (0 / -inf) mask of the keys past each row's position, made once
        per forward for every layer: SDPA would turn a boolean mask into this very tensor in every
        layer."""
        unseen_BL = torch.arange(self.L, device=self.pos_B.device) > self.pos_B[:, None]
        return self.zero.masked_fill(unseen_BL, float("-inf"))[:, None, None, :]

    def attend(self, attention, layer: int, q_BHSC, k_BGSC, v_BGSC) -> torch.Tensor:
        return attention.decode(layer, self, q_BHSC, k_BGSC, v_BGSC)
