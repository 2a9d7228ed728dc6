"""Attention over the KV cache: the math of a rollout forward's attention layers, for either cache.

`Attention` is built once per engine, with the decode kernel decided then (`decode_kernel`: the
Triton split-K kernel of rollout/decode_attention.py where it runs, else the torch path). Each
forward hands the model a `KVForward` (the attention and that forward's batch, kv/batch.py), and
each attention layer calls `attend` with its queries and new keys:
- prefill: the new keys go where the batch says (`store`), then causal attention over the new keys
  alone (fresh sequences);
- decode: each row's new key and value into its block (`write_BG`), then attention over each row's
  keys so far: the kernel reads them where the cache holds them, over the row's own length; the
  torch path reads the batch's first L key positions of each row (`read.gather`) with the keys
  past a row's position masked (`attend_keys`).
GQA everywhere: query head h reads KV group h // (H/G), as HF's repeat_kv lays them out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from megatron_rl.models.moe import widens
from megatron_rl.rollout.kv.batch import DecodeBatch, PrefillBatch
from megatron_rl.rollout.kv.cache import KVCache

ATTENTION = ("auto", "triton", "torch")


def decode_kernel(choice: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> Callable | None:
    """The decode kernel that `choice` (one of `ATTENTION`) picks here: "auto" the Triton kernel
    where it runs, else None (the torch path); "triton" the kernel or an error; "torch" None."""
    if choice not in ATTENTION:
        raise ValueError(f"attention: expected auto, triton or torch, got {choice!r}")
    if choice == "torch":
        return None
    # Deferred: a heavy optional package (triton), imported only where the kernel may run.
    from megatron_rl.rollout import decode_attention

    if decode_attention.available(device, head_dim, dtype):
        return decode_attention.decode_attention
    if choice == "triton":
        raise ValueError(f"the Triton decode kernel does not run here ({device}, head dim {head_dim})")
    return None


def attend_keys(q_BHSC: torch.Tensor, K_BGLC: torch.Tensor, V_BGLC: torch.Tensor,
                mask_B11L: torch.Tensor) -> torch.Tensor:
    """The torch path's decode attention: each row's one query per head over its first L keys,
    those past its position masked (`mask_B11L`: a masked key adds an exact zero, so attending over
    L >= a row's length leaves its result unchanged). In float32/float64 it is two batched matmuls
    and a softmax over each KV group's H/G query heads: at one query per head SDPA's CPU flash
    kernel spends its time on blocking made for long queries (decode is 20% faster this way:
    tools/bench_engine.py). Half types keep SDPA, whose kernels hold the scores and the softmax in
    fp32."""
    if widens(q_BHSC.dtype):
        return F.scaled_dot_product_attention(q_BHSC, K_BGLC, V_BGLC, attn_mask=mask_B11L, enable_gqa=True)
    B, H, _, C = q_BHSC.shape
    G = K_BGLC.shape[1]
    q_BGNC = q_BHSC.view(B, G, H // G, C) * C ** -0.5  # SDPA's default scale
    s_BGNL = torch.matmul(q_BGNC, K_BGLC.transpose(-1, -2)).add_(mask_B11L)
    return torch.matmul(s_BGNL.softmax(-1), V_BGLC).view(B, H, 1, C)


class Attention:
    """Attention over `cache`'s keys and values, decode through `kernel` (None: the torch path)."""

    def __init__(self, cache: KVCache, kernel: Callable | None = None):
        self.cache, self.kernel = cache, kernel

    def prefill(self, layer: int, batch: PrefillBatch, q_BHSC: torch.Tensor, k_BGSC: torch.Tensor,
                v_BGSC: torch.Tensor) -> torch.Tensor:
        batch.store.store(self.cache.k[layer], self.cache.v[layer], k_BGSC, v_BGSC)
        # Fresh sequences: the new keys are all there is.
        return F.scaled_dot_product_attention(q_BHSC, k_BGSC, v_BGSC, is_causal=True, enable_gqa=True)

    def decode(self, layer: int, batch: DecodeBatch, q_BHSC: torch.Tensor, k_BGSC: torch.Tensor,
               v_BGSC: torch.Tensor) -> torch.Tensor:
        K, V = self.cache.k[layer], self.cache.v[layer]
        C, rows = K.shape[-1], batch.write_BG.view(-1)
        K.view(-1, C).index_copy_(0, rows, k_BGSC.reshape(-1, C))
        V.view(-1, C).index_copy_(0, rows, v_BGSC.reshape(-1, C))
        if self.kernel is not None:
            return batch.read.kernel(self.kernel, q_BHSC[:, :, 0], K, V, batch.slot_B, batch.pos_B + 1)[:, :, None]
        K_BGLC, V_BGLC = batch.read.gather(K, V, batch.L)
        return attend_keys(q_BHSC, K_BGLC, V_BGLC, batch.mask_B11L)


@dataclass(frozen=True)
class KVForward:
    """One rollout forward through the KV cache: what the model's attention layers call
    (models/qwen3_moe.py `KVForwardLike`)."""

    attention: Attention
    batch: PrefillBatch | DecodeBatch

    @property
    def max_len(self) -> int:
        return self.attention.cache.max_len

    def attend(self, layer: int, q_BHSC: torch.Tensor, k_BGSC: torch.Tensor, v_BGSC: torch.Tensor) -> torch.Tensor:
        """Store the new keys/values of `layer`; return the queries' attention output [B, H, S, C]."""
        return self.batch.attend(self.attention, layer, q_BHSC, k_BGSC, v_BGSC)
