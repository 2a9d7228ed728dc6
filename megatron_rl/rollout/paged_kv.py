"""A paged KV cache: pages of `page_size` positions in one pool per layer, a block table per
sequence (vLLM's PagedAttention, nano-vllm's `BlockManager`).

Shapes: per layer, K and V of [pages + 1, G, P, C] (the last page is scratch, where the padding
rows of a decode bucket write). A sequence is a handle (`slot`, as in the slot cache, so the engine
and the decode step see one interface) with a block table: page j holds its positions
jP..(j+1)P-1. Pages are taken as a sequence grows (`grow`, before each decode step) and given back
when it ends; the samples of one GRPO group hold their prompt's full pages together (`fork`: the
last, partial page is copied, as each sample writes its own tokens there next).

Decode attention reads each row's pages. On CUDA, the Triton split-K kernel of the slot cache
with the block table (rollout/decode_attention.py): each key's page looked up in the kernel, over
the row's own length, in the same chunks and order as the slot cache's, and the block table a
static device tensor updated in place as pages are taken, so the decode CUDA graphs capture it. The
torch path gathers the block table's first ceil(L/P) entries of each row (entries past a row's
pages name the zeroed scratch page) and masks the keys past a row's length, over the same L key
positions as the slot cache's torch path, so every score and sum is the slot cache's, bit for bit.

Admission (`admissible`): a request is admitted while its predicted KV (prompt + predicted
response, in pages) fits in the free pages, less the growth promised to the live sequences and
less a reserve for those that outlive their prediction; when the pool still runs out, the engine
preempts its newest request and recomputes it later (rollout/engine.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_rl.config import require, require_size
from megatron_rl.rollout.kv_cache import CacheTensors, SlotKVCache
from megatron_rl.rollout.pages import PageAllocator

KV_KINDS = ("slots", "paged")


def require_kv(kind: str, page_size: int, reserve: float, where: str) -> None:
    """The KV fields of a config (`where`: their prefix, e.g. `generation.`)."""
    require(kind in KV_KINDS, f"{where}kv: expected one of {', '.join(KV_KINDS)}, got {kind!r}")
    require_size(page_size, f"{where}kv_page_size")
    require(0 <= reserve < 1, f"{where}kv_reserve: expected in [0, 1), got {reserve}")


def build_kv_cache(kind: str, mcfg, slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
                   pages: int | None = None, page_size: int = 16, reserve: float = 0.1):
    """The engine's KV cache: `slots` sequences at most; paged, `pages` pages (default: the
    slots' bytes, `slots x ceil(max_len / page_size)` pages)."""
    if kind == "slots":
        return SlotKVCache(mcfg.num_layers, slots, mcfg.num_query_groups, max_len, mcfg.kv_channels, dtype, device)
    if kind != "paged":
        raise ValueError(f"kv: expected one of {KV_KINDS}, got {kind!r}")
    pages = slots * math.ceil(max_len / page_size) if pages is None else pages
    return PagedKVCache(mcfg.num_layers, slots, pages, page_size, mcfg.num_query_groups, max_len,
                        mcfg.kv_channels, dtype, device, reserve)


class PagedKVCache(CacheTensors):
    shares_prefix = True

    def __init__(self, num_layers: int, slots: int, pages: int, page_size: int, groups: int, max_len: int,
                 channels: int, dtype: torch.dtype, device: torch.device | str = "cpu", reserve: float = 0.1):
        self.num_layers, self.page_size, self.max_len = num_layers, page_size, max_len
        self.shape = (pages + 1, groups, page_size, channels)
        self.slots, self.scratch, self.scratch_page = slots, slots, pages
        self.dtype, self.device = dtype, torch.device(device)
        self.pages_per_seq = math.ceil(max_len / page_size)
        self.reserve_pages = math.ceil(reserve * pages)
        self.pool = PageAllocator(pages)
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        # Each sequence's predicted positions (admission's promise), and its current length.
        self.predicted = [0] * slots
        self.lengths = [0] * slots
        self.free = list(range(slots - 1, -1, -1))
        # Every row's page ids on the device; unused entries (and the scratch sequence's) name the scratch page.
        self.block_table = torch.full((slots + 1, self.pages_per_seq), pages, dtype=torch.long, device=self.device)
        self.generation = 0
        self.reclaim_memory()
        self.pages_shared = 0  # pages a sequence got from its group instead of computing them
        self.peak_pages = 0
        self.kernel = None  # the decode-attention kernel, set by the engine where one runs
        self._decode_constants()
        self._groups_G1 = torch.arange(groups, device=self.device)[:, None]

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

    def prefill(self, slots: list[int], new_tokens: list[int]) -> torch.Tensor:
        """Fresh `slots` get pages for their `new_tokens` positions; returns the queries' positions [B, S]."""
        if any(self.lengths[s] or self.tables[s] for s in slots):
            raise RuntimeError("prefill of a sequence that already holds keys")
        S = max(new_tokens)
        if S > self.max_len:
            raise RuntimeError(f"sequence longer than the KV cache's {self.max_len} positions")
        self._slots, self._new, self._decode = list(slots), list(new_tokens), None
        self._S, self._route_rows = S, None
        where = []  # (row, position, page, offset) of every real position
        for b, (s, n) in enumerate(zip(slots, new_tokens)):
            self._cover(s, n)
            where += [(b, p, self.tables[s][p // self.page_size], p % self.page_size) for p in range(n)]
        self._b_M, self._s_M, self._page_M, self._off_M = torch.tensor(where, device=self.device).T
        return torch.arange(S, device=self.device).expand(len(slots), S)

    def decode(self, slot_B: torch.Tensor, pos_B: torch.Tensor, L: int, run: slice | None) -> torch.Tensor:
        """As the slot cache's: row b appends at `pos_B[b]` of sequence `slot_B[b]` (pages taken by `grow`)."""
        self._decode, self._L = (slot_B, pos_B), L
        table_BJ = self.block_table.index_select(0, slot_B)
        page_B = table_BJ.gather(1, (pos_B // self.page_size)[:, None])[:, 0]
        self._decode_inputs(page_B, pos_B % self.page_size, pos_B, L)
        if self.kernel is None:
            # Row b's first pages_for(L) pages, each KV group's P positions one contiguous block of
            # K viewed [pages x G, P x C], in attention's [B, G, n] order: every layer gathers them
            # with one index_select per tensor, straight into the layout attention reads. (One index
            # per position takes P times the indices; a page gather then a permuting copy moves
            # the bytes twice.)
            self._blocks_R = (table_BJ[:, None, :self.pages_for(L)] * self.shape[1] + self._groups_G1).reshape(-1)
        return pos_B[:, None]

    def attend(self, layer: int, q_BHSC: torch.Tensor, k_BGSC: torch.Tensor, v_BGSC: torch.Tensor) -> torch.Tensor:
        K, V = self.k[layer], self.v[layer]
        if self._decode is None:
            K[self._page_M, :, self._off_M] = k_BGSC.permute(0, 2, 1, 3)[self._b_M, self._s_M]
            V[self._page_M, :, self._off_M] = v_BGSC.permute(0, 2, 1, 3)[self._b_M, self._s_M]
            return F.scaled_dot_product_attention(q_BHSC, k_BGSC, v_BGSC, is_causal=True, enable_gqa=True)
        self._append(K, V, k_BGSC, v_BGSC)
        slot_B, pos_B = self._decode
        if self.kernel is not None:
            return self.kernel(q_BHSC[:, :, 0], K, V, slot_B, pos_B + 1, table_SJ=self.block_table,
                               max_len=self.max_len)[:, :, None]
        G, P, C = self.shape[1:]
        shape_BGLC = (slot_B.shape[0], G, -1, C)  # n x P positions, the first L attended
        K_BGLC = K.view(-1, P * C).index_select(0, self._blocks_R).view(shape_BGLC)[:, :, : self._L]
        V_BGLC = V.view(-1, P * C).index_select(0, self._blocks_R).view(shape_BGLC)[:, :, : self._L]
        return self._attend_keys(q_BHSC, K_BGLC, V_BGLC)
