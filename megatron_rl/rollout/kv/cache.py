"""What the slot and the paged KV cache share: the K and V tensors, and the sequences they hold.

Both caches (slots.py, paged.py) hold per layer one K and one V of [blocks + 1, G, R, C]: a block
is a slot of R = max_len positions, or a page of R = page_size positions, and the last block is
scratch, where the padding rows of a CUDA-graph bucket write (no sequence ever holds it). A sequence
is a handle, `slot` in both (0..slots-1; `scratch` = slots names no sequence), with its length on
the host. A detached rank frees the tensors for its lease (`release_memory`) and allocates them
again before the restore (`reclaim_memory`); `generation` counts the allocations, as a captured
CUDA graph holds their addresses.

A cache keeps only this bookkeeping. What one forward covers is a batch it makes and returns
(`prefill_batch`, `decode_batch`: batch.py), which the attention reads (attention.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.rollout.kv.batch import PrefillBatch


@dataclass(frozen=True)
class KVLayout:
    """What every KV tensor of one model looks like: its layers, KV groups (G), head dim (C), dtype
    and device."""

    num_layers: int
    groups: int
    channels: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")

    @classmethod
    def of(cls, mcfg, dtype: torch.dtype, device: torch.device | str) -> KVLayout:
        """The layout of the model configuration `mcfg` (a `MoEModelConfig`) in `dtype` on `device`."""
        return cls(mcfg.num_layers, mcfg.num_query_groups, mcfg.kv_channels, dtype, torch.device(device))


class KVCache:
    """`slots` sequences of at most `max_len` positions, over per-layer K and V of [blocks + 1, G,
    R, C] (`blocks` slots or pages of R positions)."""

    def __init__(self, layout: KVLayout, slots: int, max_len: int, blocks: int, positions: int):
        self.layout, self.slots, self.scratch, self.max_len = layout, slots, slots, max_len
        self.num_layers, self.dtype, self.device = layout.num_layers, layout.dtype, layout.device
        self.shape = (blocks + 1, layout.groups, positions, layout.channels)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.generation = 0  # bumped whenever the K/V tensors are (re)allocated
        self.reclaim_memory()
        # Per-slot sequence lengths as Python ints: the engine's bookkeeping is on the host, so
        # the checks and the key length cost no tensor ops.
        self.lengths = [0] * slots
        self.free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest free slot first
        # What every decode forward reuses: each KV group's first row within a block of K viewed as
        # rows [blocks x G x R, C], and the zero of the torch path's additive mask.
        self.group_rows_G = torch.arange(layout.groups, device=self.device) * positions
        self.zero = torch.zeros((), dtype=self.dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def release_memory(self) -> int:
        """Free the K/V tensors (no live request may remain); returns the bytes freed."""
        if len(self.free) != self.slots:
            raise RuntimeError(f"KV cache released with {self.slots - len(self.free)} live sequences")
        freed = self.nbytes
        self.k, self.v = [], []
        return freed

    def reclaim_memory(self) -> None:
        """(Re)allocate the K/V tensors: at construction, and before a detached rank rejoins."""
        self.k = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.generation += 1

    def commit(self, batch: PrefillBatch) -> None:
        """After a prefill forward: the positions it wrote become part of each sequence."""
        for s, n in zip(batch.slots, batch.new):
            self.lengths[s] += n

    def _check_prefill(self, slots: list[int], S: int) -> None:
        if S > self.max_len:
            raise RuntimeError(f"sequence longer than the KV cache's {self.max_len} positions")
        if any(self.lengths[s] for s in slots):
            raise RuntimeError("prefill of a sequence that already holds keys")

    def _write_rows(self, block_B: torch.Tensor, off_B: torch.Tensor) -> torch.Tensor:
        """Where a decode forward's new keys go, for every layer: row b's position `off_B[b]` of
        block `block_B[b]`, per KV group, as rows of K viewed [-1, C] (one index, one `index_copy_`
        per layer and tensor; a scatter or a two-index put costs more on CPU). [B, G]."""
        G, R = self.shape[1], self.shape[2]
        return torch.add(off_B, block_B, alpha=G * R)[:, None] + self.group_rows_G
