"""A slot-based KV cache: one slot per live request, preallocated to the longest sequence.

Shapes: per layer, K and V of [slots + 1, G, L_max, C] (one scratch slot). A request keeps its slot
from prefill to its last token; a finished request's slot is freed and reused. `prefill` / `decode`
fix which slots the next forward covers, so a rank's batch can shrink (finished requests leave)
without copying the cache.

How many slots fit is `kv_cache_slots`: on a GPU, what the device has left after the weights; on CPU,
the configured batch (host memory is not the limit there). A detached rank frees the cache for its
lease (`release_memory`) and re-allocates it before the restore (`reclaim_memory`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl.errors import FlexFloorError
from megatron_rl.models.moe import widens


def kv_numel(num_layers: int, groups: int, positions: int, channels: int) -> int:
    """Elements of K and V of `positions` positions of one sequence in every layer: the one KV
    formula (slots, the memory budget's bytes per token, a migrated request's rows)."""
    return num_layers * 2 * groups * positions * channels


def slot_bytes(num_layers: int, groups: int, max_len: int, channels: int, dtype: torch.dtype) -> int:
    """K and V of one sequence of `max_len` positions in every layer."""
    return kv_numel(num_layers, groups, max_len, channels) * dtype.itemsize


def kv_budget_slots(total: int, free: int, peak: int, current: int, fraction: float, per_slot: int,
                    max_slots: int) -> int:
    """nano-vllm's rule: the cache may take `fraction` of the device's `total` bytes, less what is
    in use (`total - free`: every process's memory, our weights included) and less this process's
    activation peak above its current allocation (`peak - current`, from a warm-up if one ran);
    at most `max_slots` slots, besides the scratch slot. Fewer than one slot is an error naming the numbers."""
    budget = int(total * fraction) - (total - free) - max(0, peak - current)
    # One slot more than the requests' is allocated: the scratch slot of padded decode rows.
    slots = min(max_slots, max(0, budget) // per_slot - 1)
    if slots < 1:
        gib = 2**30
        raise FlexFloorError(
            f"kv_memory_fraction {fraction}: the KV cache gets {max(0, budget) / gib:.2f} GiB of the device's "
            f"{total / gib:.1f} GiB ({(total - free) / gib:.1f} GiB in use), one sequence needs "
            f"{per_slot / gib:.3f} GiB; raise kv_memory_fraction, shorten responses or use more ranks")
    return slots


def kv_cache_slots(device: torch.device, per_slot: int, fraction: float, max_slots: int) -> int:
    """Slots for this rank's cache, measured on `device` after the weights are loaded."""
    if device.type != "cuda":
        return max_slots
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return kv_budget_slots(total, free, stats.get("allocated_bytes.all.peak", 0),
                           stats.get("allocated_bytes.all.current", 0), fraction, per_slot, max_slots)


class CacheTensors:
    """What the slot and the paged cache share: per-layer K/V tensors of `shape` that a detached
    rank frees and reclaims, and where a forward's routes go (both name a sequence by its slot and
    say in `prefill`/`decode` which slots and positions the next forward covers)."""

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

    def _decode_constants(self) -> None:
        """What every decode forward reuses: each KV group's first row within a block (a slot, or
        a page) of K viewed as rows [blocks x G x R, C], and the mask's zero."""
        self._group_rows_G = torch.arange(self.shape[1], device=self.device) * self.shape[2]
        self._zero = torch.zeros((), dtype=self.dtype, device=self.device)

    def _decode_inputs(self, block_B: torch.Tensor, off_B: torch.Tensor, pos_B: torch.Tensor, L: int) -> None:
        """Made once per decode forward, for every layer: where each row's new key goes (row b at
        position `off_B[b]` of block `block_B[b]`: one index, one `index_copy_` per layer and tensor;
        a scatter or a two-index put costs more on CPU) and, for the torch path, the [B, 1, 1, L]
        mask of the keys past each row's position, additive (0 / -inf): SDPA would turn a boolean
        mask into this very tensor in every layer."""
        G, R = self.shape[1], self.shape[2]
        self._write_BG = torch.add(off_B, block_B, alpha=G * R)[:, None] + self._group_rows_G
        if self.kernel is None:
            unseen_BL = torch.arange(L, device=self.device) > pos_B[:, None]
            self._mask_B11L = self._zero.masked_fill(unseen_BL, float("-inf"))[:, None, None, :]

    def _append(self, K: torch.Tensor, V: torch.Tensor, k_BGSC: torch.Tensor, v_BGSC: torch.Tensor) -> None:
        """A decode forward's new keys and values into one layer's K and V (`_decode_inputs`)."""
        C, rows = self.shape[3], self._write_BG.view(-1)
        K.view(-1, C).index_copy_(0, rows, k_BGSC.reshape(-1, C))
        V.view(-1, C).index_copy_(0, rows, v_BGSC.reshape(-1, C))

    def _attend_keys(self, q_BHSC: torch.Tensor, K_BGLC: torch.Tensor, V_BGLC: torch.Tensor) -> torch.Tensor:
        """The torch path's decode attention: each row's one query per head over its first L keys,
        those past its position masked (`_mask_B11L`: a masked key adds an exact zero, so attending
        over L >= a row's length leaves its result unchanged). In float32/float64 it is two batched
        matmuls and a softmax over each KV group's H/G query heads: at one query per head SDPA's
        CPU flash kernel spends its time on blocking made for long queries (decode is 20% faster
        this way: tools/bench_engine.py). Half types keep SDPA, whose kernels hold the scores and
        the softmax in fp32."""
        if widens(q_BHSC.dtype):
            return F.scaled_dot_product_attention(q_BHSC, K_BGLC, V_BGLC, attn_mask=self._mask_B11L, enable_gqa=True)
        B, H, _, C = q_BHSC.shape
        G = K_BGLC.shape[1]
        q_BGNC = q_BHSC.view(B, G, H // G, C) * C ** -0.5  # SDPA's default scale
        s_BGNL = torch.matmul(q_BGNC, K_BGLC.transpose(-1, -2)).add_(self._mask_B11L)
        return torch.matmul(s_BGNL.softmax(-1), V_BGLC).view(B, H, 1, C)

    def commit(self) -> None:
        """After a prefill: the written tokens become part of each sequence."""
        for s, n in zip(self._slots, self._new):
            self.lengths[s] += n
        self._slots, self._new = [], []

    def route_rows(self, T: int) -> torch.Tensor:
        """The forward's T rows as flat (slot x max_len + position) indices, for the route buffer
        of models/routes.py: a decode's rows in order (a layer fed only the real rows gets the
        leading ones: padding rows come last); a prefill's B x S rows, or, T smaller, only its
        real tokens in row order (megatron-core's block gets `h[token_mask]`)."""
        if self._decode is not None:
            slot_B, pos_B = self._decode
            return (slot_B * self.max_len + pos_B)[:T]
        if self._route_rows is None or self._route_rows[0] != T:
            if T == len(self._slots) * self._S:
                rows = [s * self.max_len + p for s in self._slots for p in range(self._S)]
            else:
                rows = [s * self.max_len + p for s, n in zip(self._slots, self._new) for p in range(n)]
            self._route_rows = (T, torch.tensor(rows, device=self.device))
        return self._route_rows[1]


class SlotKVCache(CacheTensors):
    """Per layer K and V of [slots + 1, G, L_max, C]: the last slot is scratch, where the padding
    rows of a CUDA-graph bucket write (no request ever holds it).

    A forward first says what it covers: `prefill(slots, S)` (fresh sequences, S new positions
    each: attention is causal over the new keys alone, no mask tensor) or `decode(slot_B, pos_B,
    L, run)` (one new token per row at position pos_B, device tensors: the engine's static input
    buffers). Decode attention reads each row's own length: with the Triton split-K kernel on
    CUDA (rollout/decode_attention.py), or, the torch path (`_attend_keys`), over the first L key
    positions with a [B, 1, 1, L] mask made once per forward from pos_B on the device.

    The sequence methods the engine calls (`admissible`, `alloc`, `grow`, `export_kv`,
    `import_kv`) are the paged cache's too (rollout/paged_kv.py), so either serves the engine.
    """

    shares_prefix = False  # every sequence prefills its own prompt into its slot

    def __init__(self, num_layers: int, slots: int, groups: int, max_len: int, channels: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.shape, self.num_layers = (slots + 1, groups, max_len, channels), num_layers
        self.slots, self.scratch = slots, slots
        self.dtype, self.device = dtype, torch.device(device)
        # Bumped whenever the K/V tensors are (re)allocated: a captured CUDA graph holds their addresses.
        self.generation = 0
        self.reclaim_memory()
        # Per-slot sequence lengths as Python ints: the engine's bookkeeping is on the host, so
        # the checks and the key length below cost no tensor ops.
        self.lengths = [0] * slots
        self.max_len = max_len
        self.free = list(range(slots - 1, -1, -1))
        self._slots: list[int] = []
        self._new: list[int] = []
        self.kernel = None  # the decode-attention kernel, set by the engine where one runs
        self._decode_constants()

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

    def prefill(self, slots: list[int], new_tokens: list[int]) -> torch.Tensor:
        """The next forward writes positions 0..S-1 (S = max(new_tokens)) of the fresh `slots`;
        returns the queries' positions [B, S]. Padding positions past a row's real tokens are
        written too, never attended to by a real query (causal, right padding), and overwritten
        by the row's next tokens."""
        S = max(new_tokens)
        if S > self.max_len:
            raise RuntimeError(f"sequence longer than the KV cache's {self.max_len} positions")
        if any(self.lengths[s] for s in slots):
            raise RuntimeError("prefill of a slot that already holds keys")
        self._slots, self._new, self._decode = list(slots), list(new_tokens), None
        first, B = slots[0], len(slots)
        self._rows = slice(first, first + B) if slots == list(range(first, first + B)) else \
            torch.tensor(slots, device=self.device)
        self._S = S
        self._route_rows = None
        return torch.arange(S, device=self.device).expand(B, S)

    def decode(self, slot_B: torch.Tensor, pos_B: torch.Tensor, L: int, run: slice | None) -> torch.Tensor:
        """The next forward appends one token to each row: slot `slot_B[b]`, position `pos_B[b]`
        (device tensors; a padding row names the scratch slot). `L` > every pos_B is the key length
        the torch path attends over (the CUDA-graph path passes L_max: a captured graph has one
        shape); `run` is `slot_B` as a slice when the slots are consecutive (a view, no gather).
        Returns the positions [B, 1]. `commit` is the engine's, which knows the rows' lengths."""
        self._decode, self._run, self._L = (slot_B, pos_B), run, L
        self._decode_inputs(slot_B, pos_B, pos_B, L)  # a slot is one block of L_max positions
        return pos_B[:, None]

    def attend(self, layer: int, q_BHSC: torch.Tensor, k_BGSC: torch.Tensor, v_BGSC: torch.Tensor) -> torch.Tensor:
        K, V = self.k[layer], self.v[layer]
        if self._decode is None:
            K[self._rows, :, : self._S] = k_BGSC
            V[self._rows, :, : self._S] = v_BGSC
            # Fresh sequences: the new keys are all there is. GQA: query head h reads KV group
            # h // (H/G), as HF's repeat_kv lays them out (`enable_gqa`).
            return F.scaled_dot_product_attention(q_BHSC, k_BGSC, v_BGSC, is_causal=True, enable_gqa=True)
        slot_B, pos_B = self._decode
        self._append(K, V, k_BGSC, v_BGSC)
        if self.kernel is not None:
            return self.kernel(q_BHSC[:, :, 0], K, V, slot_B, pos_B + 1)[:, :, None]
        if self._run is not None:
            K_BGLC, V_BGLC = K[self._run, :, : self._L], V[self._run, :, : self._L]
        else:
            # index_select copies the rows' first L positions; advanced indexing takes a slower
            # generic path on CPU.
            K_BGLC = K[:, :, : self._L].index_select(0, slot_B)
            V_BGLC = V[:, :, : self._L].index_select(0, slot_B)
        return self._attend_keys(q_BHSC, K_BGLC, V_BGLC)
