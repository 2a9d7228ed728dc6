"""A paged KV cache: pages of `page_size` positions in one pool per layer, a block table per
sequence (vLLM's PagedAttention, nano-vllm's `BlockManager`).

Shapes: per layer, K and V of [pages + 1, G, P, C] (the last page is scratch, where the padding
rows of a decode bucket write; kv/cache.py). A sequence is a handle (`slot`, as in the slot cache, so the engine
and the decode step see one interface) with a block table: page j holds its positions
jP..(j+1)P-1. Pages are taken as a sequence grows (`grow`, before each decode step) and given back
when it ends; the samples of one GRPO group hold their prompt's full pages together (`fork`: the
last, partial page is copied, as each sample writes its own tokens there next).

Decode attention reads each row's pages. On CUDA, the Triton split-K kernel of the slot cache
with the block table (rollout/decode_attention.py): each key's page looked up in the kernel, over
the row's own length, in the same chunks and order as the slot cache's, and the block table a
static device tensor updated in place as pages are taken, so the decode CUDA graphs capture it
(`PageRead`). The torch path gathers the block table's first ceil(L/P) entries of each row (entries past a row's
pages name the zeroed scratch page) and masks the keys past a row's length, over the same L key
positions as the slot cache's torch path, so every score and sum is the slot cache's, bit for bit.

Admission (`admissible`): a request is admitted while its predicted KV (prompt + predicted
response, in pages) fits in the free pages, less the growth promised to the live sequences and
less a reserve for those that outlive their prediction; when the pool still runs out, the engine
preempts its newest request and recomputes it later (rollout/scheduler.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rl.rollout.kv.batch import DecodeBatch, PrefillBatch
from megatron_rl.rollout.kv.cache import KVCache, KVLayout
from megatron_rl.rollout.kv.pages import PageAllocator
from megatron_rl.rollout.kv.route_rows import DecodeRows, PrefillRows


@dataclass(frozen=True)
class PageRows:
    """A prefill's keys go position by position into its sequences' pages: real position `s_M[m]`
    of row `b_M[m]` at offset `off_M[m]` of page `page_M[m]` (padding positions are not written)."""

    b_M: torch.Tensor
    s_M: torch.Tensor
    page_M: torch.Tensor
    off_M: torch.Tensor

    def store(self, K, V, k_BGSC, v_BGSC) -> None:
        K[self.page_M, :, self.off_M] = k_BGSC.permute(0, 2, 1, 3)[self.b_M, self.s_M]
        V[self.page_M, :, self.off_M] = v_BGSC.permute(0, 2, 1, 3)[self.b_M, self.s_M]


@dataclass(frozen=True)
class PageRead:
    """A decode row's keys are in the pages of its block table: `table_BJ`, the rows' tables (the
    kernel looks each key's page up in the cache's whole `table_SJ`, a static device tensor)."""

    table_BJ: torch.Tensor
    table_SJ: torch.Tensor
    groups_G1: torch.Tensor
    L: int
    page_size: int
    max_len: int

    @functools.cached_property
    def blocks_R(self) -> torch.Tensor:
        """Row b's first ceil(L / P) pages, each KV group's P positions one contiguous block of K
        viewed [pages x G, P x C], in attention's [B, G, n] order: every layer gathers them with
        one index_select per tensor, straight into the layout attention reads. (One index per
        position takes P times the indices; a page gather then a permuting copy moves the bytes
        twice.) Made once per forward, by the torch path's first layer."""
        n = -(-self.L // self.page_size)
        return (self.table_BJ[:, None, :n] * self.groups_G1.shape[0] + self.groups_G1).reshape(-1)

    def gather(self, K, V, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        G, P, C = K.shape[1:]
        shape_BGLC = (self.table_BJ.shape[0], G, -1, C)  # n x P positions, the first L attended
        K_BGLC = K.view(-1, P * C).index_select(0, self.blocks_R).view(shape_BGLC)[:, :, :L]
        V_BGLC = V.view(-1, P * C).index_select(0, self.blocks_R).view(shape_BGLC)[:, :, :L]
        return K_BGLC, V_BGLC

    def kernel(self, kernel: Callable, q_BHC, K, V, slot_B, len_B) -> torch.Tensor:
        return kernel(q_BHC, K, V, slot_B, len_B, table_SJ=self.table_SJ, max_len=self.max_len)


class PagedKVCache(KVCache):
    shares_prefix = True

    def __init__(self, layout: KVLayout, slots: int, max_len: int, pages: int, page_size: int = 16,
                 reserve: float = 0.1):
        super().__init__(layout, slots, max_len, blocks=pages, positions=page_size)
        self.page_size, self.scratch_page = page_size, pages
        self.pages_per_seq = math.ceil(max_len / page_size)
        self.reserve_pages = math.ceil(reserve * pages)
        self.pool = PageAllocator(pages)
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        # Each sequence's predicted positions (admission's promise); its length is `lengths`.
        self.predicted = [0] * slots
        # Every row's page ids on the device; unused entries (and the scratch sequence's) name the scratch page.
        self.block_table = torch.full((slots + 1, self.pages_per_seq), pages, dtype=torch.long, device=self.device)
        self.pages_shared = 0  # pages a sequence got from its group instead of computing them
        self.peak_pages = 0
        self.groups_G1 = torch.arange(layout.groups, device=self.device)[:, None]

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    @property
    def capacity(self) -> int:
        """The most positions one sequence can ever hold: its block table, or the whole pool."""
        return min(self.max_len, self.pool.pages * self.page_size)

    # -- sequences and pages ------------------------------------------------------------------

    def admissible(self, now: list[int], total: list[int], live: int, shared: list[int]) -> int:
        """How many of the waiting requests (in order, at most one per free sequence; `now`
        positions to prefill, `total` predicted positions at the end, `shared` positions held
        with an earlier one of them: its group's prompt, whose full pages it will share) to admit,
        with `live` sequences running. A request is admitted whatever its prediction while the pool
        holds every admitted sequence at `max_len` (the slot cache's guarantee, in the same bytes by
        default): the reserve guards predictions, and a pool that cannot run out needs none."""
        promised = sum(max(0, self.pages_for(self.predicted[s]) - len(self.tables[s]))
                       for s in range(self.slots) if self.tables[s])
        avail = len(self.pool.free) - promised - self.reserve_pages
        free_now, n = len(self.pool.free), 0
        for pos, want, common in zip(now, total, shared):
            own = common // self.page_size  # full pages shared, not taken
            need, hold = self.pages_for(max(pos, want)) - own, self.pages_for(pos) - own
            safe = (live + n + 1) * self.pages_per_seq <= self.pool.pages
            if hold > free_now or (need > avail and (n or live) and not safe):
                break
            avail, free_now, n = avail - need, free_now - hold, n + 1
        return n

    def alloc(self, predicted: int = 0) -> int:
        if not self.free:
            raise RuntimeError("KV cache has no free sequence")
        s = self.free.pop()
        self.lengths[s], self.predicted[s] = 0, predicted
        return s

    def release(self, slot: int) -> None:
        for page in self.tables[slot]:
            self.pool.release(page)
        self.tables[slot] = []
        self.block_table[slot].fill_(self.scratch_page)
        self.free.append(slot)

    def _take(self, slot: int, page: int) -> None:
        self.block_table[slot, len(self.tables[slot])] = page
        self.tables[slot].append(page)
        self.peak_pages = max(self.peak_pages, self.pool.used)

    def _cover(self, slot: int, positions: int) -> None:
        while len(self.tables[slot]) < self.pages_for(positions):
            self._take(slot, self.pool.alloc())

    def grow(self, slots: list[int]) -> bool:
        """A page for each row whose next position starts one; False (nothing taken) when the
        pool has too few free pages."""
        need = [s for s in slots if self.lengths[s] == len(self.tables[s]) * self.page_size]
        if len(need) > len(self.pool.free):
            return False
        for s in need:
            self._take(s, self.pool.alloc())
        return True

    def fork(self, src: int, dst: int) -> None:
        """`dst` (fresh) continues `src`'s keys: its full pages shared, its last partial page copied."""
        n = self.lengths[src]
        full = n // self.page_size
        for page in self.tables[src][:full]:
            self._take(dst, self.pool.share(page))
        self.pages_shared += full
        if n % self.page_size:
            page, mine = self.tables[src][full], self.pool.alloc()
            self._take(dst, mine)
            for t in self.k + self.v:
                t[mine] = t[page]
        self.lengths[dst] = n

    def export_kv(self, slot: int, held: int) -> torch.Tensor:
        """K and V of the first `held` positions, every layer, as one flat tensor of [G, held, C]
        blocks (the slot cache's format: a migrated request reads the same on either cache).
        Shared pages are copied out."""
        pages = torch.tensor(self.tables[slot][: self.pages_for(held)], device=self.device)
        G, C = self.shape[1], self.shape[3]
        return torch.cat([t[pages].permute(1, 0, 2, 3).reshape(G, -1, C)[:, :held].reshape(-1)
                          for layer in range(self.num_layers) for t in (self.k[layer], self.v[layer])])

    def import_kv(self, flat: torch.Tensor, held: int, predicted: int = 0) -> int:
        """A fresh sequence holding `held` positions of `flat` (`export_kv`'s format)."""
        if not self.free or self.pages_for(held) > len(self.pool.free):
            raise RuntimeError(f"no room in the paged KV cache for a migrated sequence of {held} positions")
        slot = self.alloc(predicted)
        self._cover(slot, held)
        G, C, P = self.shape[1], self.shape[3], self.page_size
        n = self.pages_for(held)
        pages = torch.tensor(self.tables[slot], device=self.device)
        for layer, chunk in enumerate(flat.split(flat.numel() // self.num_layers)):
            for t, c in zip((self.k[layer], self.v[layer]), chunk.split(chunk.numel() // 2)):
                rows = torch.zeros(G, n * P, C, dtype=t.dtype, device=t.device)
                rows[:, :held] = c.view(G, held, C)
                t[pages] = rows.view(G, n, P, C).permute(1, 0, 2, 3)
        self.lengths[slot] = held
        return slot

    # -- one forward ---------------------------------------------------------------------------

    def prefill_batch(self, slots: list[int], new_tokens: list[int]) -> PrefillBatch:
        """Fresh `slots` get pages for their `new_tokens` positions: a forward writing them."""
        if any(self.tables[s] for s in slots):
            raise RuntimeError("prefill of a sequence that already holds keys")
        S = max(new_tokens)
        self._check_prefill(slots, S)
        where = []  # (row, position, page, offset) of every real position
        for b, (s, n) in enumerate(zip(slots, new_tokens)):
            self._cover(s, n)
            where += [(b, p, self.tables[s][p // self.page_size], p % self.page_size) for p in range(n)]
        b_M, s_M, page_M, off_M = torch.tensor(where, device=self.device).T
        return PrefillBatch(list(slots), list(new_tokens), S, PageRows(b_M, s_M, page_M, off_M),
                            PrefillRows(list(slots), list(new_tokens), S, self.max_len, self.device))

    def decode_batch(self, slot_B: torch.Tensor, pos_B: torch.Tensor, L: int, run: slice | None) -> DecodeBatch:
        """As the slot cache's: row b appends at `pos_B[b]` of sequence `slot_B[b]` (pages taken by
        `grow`); `run` is not needed, a row's keys being wherever its pages are."""
        table_BJ = self.block_table.index_select(0, slot_B)
        page_B = table_BJ.gather(1, (pos_B // self.page_size)[:, None])[:, 0]
        read = PageRead(table_BJ, self.block_table, self.groups_G1, L, self.page_size, self.max_len)
        return DecodeBatch(slot_B, pos_B, L, self._write_rows(page_B, pos_B % self.page_size), read, self.zero,
                           DecodeRows(slot_B, pos_B, self.max_len))
