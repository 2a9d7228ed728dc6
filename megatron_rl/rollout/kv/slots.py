"""A slot-based KV cache: one slot per live request, preallocated to the longest sequence.

Shapes: per layer, K and V of [slots + 1, G, L_max, C] (the last slot is scratch, kv/cache.py). A
request keeps its slot from prefill to its last token; a finished request's slot is freed and
reused. A forward's batch names the slots it covers, so a rank's batch can shrink (finished
requests leave) without copying the cache.

A prefill writes positions 0..S-1 of fresh slots (`SlotRows`). Decode attention reads each row's
own slot: the Triton split-K kernel on CUDA (rollout/decode_attention.py), or, the torch path, the
slots' first L key positions (`SlotRead`: a view where the batch's slots are consecutive, else a
gather).

How many slots fit is `kv/budget.py`'s `kv_cache_slots` (the run's KV kind asks it: kv/kind.py).
The sequence methods the engine calls (`admissible`, `alloc`, `grow`, `export_kv`, `import_kv`)
are the paged cache's too (kv/paged.py), so either serves the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rl.rollout.kv.batch import DecodeBatch, PrefillBatch
from megatron_rl.rollout.kv.cache import KVCache, KVLayout
from megatron_rl.rollout.kv.route_rows import DecodeRows, PrefillRows


@dataclass(frozen=True)
class SlotRows:
    """A prefill's keys go to positions 0..S-1 of its slots: `rows`, a slice where they are
    consecutive (a view), else their indices."""

    rows: slice | torch.Tensor
    S: int

    def store(self, K, V, k_BGSC, v_BGSC) -> None:
        K[self.rows, :, : self.S] = k_BGSC
        V[self.rows, :, : self.S] = v_BGSC


@dataclass(frozen=True)
class SlotRead:
    """A decode row's keys are its slot's (`slot_B`); `run` is the same slots as a slice when they
    are consecutive (a view, no gather)."""

    slot_B: torch.Tensor
    run: slice | None

    def gather(self, K, V, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.run is not None:
            return K[self.run, :, :L], V[self.run, :, :L]
        # index_select copies the rows' first L positions; advanced indexing takes a slower
        # generic path on CPU.
        return K[:, :, :L].index_select(0, self.slot_B), V[:, :, :L].index_select(0, self.slot_B)

    def kernel(self, kernel: Callable, q_BHC, K, V, slot_B, len_B) -> torch.Tensor:
        return kernel(q_BHC, K, V, slot_B, len_B)


class SlotKVCache(KVCache):
    shares_prefix = False  # every sequence prefills its own prompt into its slot
    pages_shared = 0

    def __init__(self, layout: KVLayout, slots: int, max_len: int):
        super().__init__(layout, slots, max_len, blocks=slots, positions=max_len)

    @property
    def capacity(self) -> int:
        """The most positions one sequence can ever hold."""
        return self.max_len

    def admissible(self, now: list[int], total: list[int], live: int, shared: list[int]) -> int:
        """How many of the waiting requests (at most one per free slot) to admit: all of them
        (lengths do not matter here)."""
        return len(now)

    def grow(self, slots: list[int]) -> bool:
        return True  # a slot holds max_len positions from the start

    def export_kv(self, slot: int, held: int) -> torch.Tensor:
        """K and V of the first `held` positions of `slot`, every layer, as one flat tensor."""
        return torch.cat([t[slot, :, :held].reshape(-1) for layer in range(self.num_layers)
                          for t in (self.k[layer], self.v[layer])])

    def import_kv(self, flat: torch.Tensor, held: int, predicted: int = 0) -> int:
        """A fresh slot holding `held` positions of `flat` (`export_kv`'s format)."""
        if not self.free:
            raise RuntimeError("no free KV slot for a migrated sequence")
        slot = self.alloc()
        chunks = flat.split(flat.numel() // (2 * self.num_layers))
        for layer in range(self.num_layers):
            for t, c in zip((self.k[layer], self.v[layer]), chunks[2 * layer:2 * layer + 2]):
                t[slot, :, :held] = c.view(t.shape[1], held, t.shape[3])
        self.lengths[slot] = held
        return slot

    def alloc(self, predicted: int = 0) -> int:
        if not self.free:
            raise RuntimeError("KV cache has no free slot")
        s = self.free.pop()
        self.lengths[s] = 0
        return s

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def prefill_batch(self, slots: list[int], new_tokens: list[int]) -> PrefillBatch:
        """A forward writing positions 0..S-1 (S = max(new_tokens)) of the fresh `slots`. Padding
        positions past a row's real tokens are written too, never attended to by a real query
        (causal, right padding), and overwritten by the row's next tokens."""
        S = max(new_tokens)
        self._check_prefill(slots, S)
        first, B = slots[0], len(slots)
        rows = slice(first, first + B) if slots == list(range(first, first + B)) else \
            torch.tensor(slots, device=self.device)
        return PrefillBatch(list(slots), list(new_tokens), S, SlotRows(rows, S),
                            PrefillRows(list(slots), list(new_tokens), S, self.max_len, self.device))

    def decode_batch(self, slot_B: torch.Tensor, pos_B: torch.Tensor, L: int, run: slice | None) -> DecodeBatch:
        """A forward appending one token to each row: slot `slot_B[b]`, position `pos_B[b]` (a
        padding row names the scratch slot). `run`: `slot_B` as a slice when the slots are
        consecutive. `commit` is the engine's, which knows the rows' lengths."""
        return DecodeBatch(slot_B, pos_B, L, self._write_rows(slot_B, pos_B), SlotRead(slot_B, run), self.zero,
                           DecodeRows(slot_B, pos_B, self.max_len))
