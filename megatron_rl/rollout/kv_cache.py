"""A slot-based KV cache: one slot per live request, preallocated to the longest sequence.

Shapes: per layer, K and V of [slots, G, L_max, C]. A request keeps its slot from prefill to its last
token; a finished request's slot is freed and reused. `select(slots)` fixes which slots the next
forward covers, so a rank's batch can shrink (finished requests leave) without copying the cache.

How many slots fit is `kv_cache_slots`: on a GPU, what the device has left after the weights; on CPU,
the configured batch (host memory is not the limit there). A detached rank frees the cache for its
lease (`release_memory`) and re-allocates it before the restore (`reclaim_memory`).
"""
from __future__ import annotations

import torch

from megatron_rl.errors import FlexFloorError


def slot_bytes(num_layers: int, groups: int, max_len: int, channels: int, dtype: torch.dtype) -> int:
    """K and V of one sequence of `max_len` positions in every layer."""
    return num_layers * 2 * groups * max_len * channels * dtype.itemsize


def kv_budget_slots(total: int, free: int, peak: int, current: int, fraction: float, per_slot: int,
                    max_slots: int) -> int:
    """nano-vllm's rule: the cache may take `fraction` of the device's `total` bytes, less what is
    in use (`total - free`: every process's memory, our weights included) and less this process's
    activation peak above its current allocation (`peak - current`, from a warm-up if one ran);
    at most `max_slots` slots. Fewer than one slot is an error naming the numbers."""
    budget = int(total * fraction) - (total - free) - max(0, peak - current)
    slots = min(max_slots, max(0, budget) // per_slot)
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


class SlotKVCache:
    def __init__(self, num_layers: int, slots: int, groups: int, max_len: int, channels: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.shape, self.num_layers = (slots, groups, max_len, channels), num_layers
        self.dtype, self.device = dtype, torch.device(device)
        self.reclaim_memory()
        # Per-slot sequence lengths as Python ints: the engine's bookkeeping is on the host, so
        # the checks and the key length below cost no tensor ops.
        self.lengths = [0] * slots
        self.max_len = max_len
        self.free = list(range(slots - 1, -1, -1))
        self._slots: list[int] = []
        self._new: list[int] = []
        self._run: slice | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def release_memory(self) -> int:
        """Free the K/V tensors (no live request may remain); returns the bytes freed."""
        if len(self.free) != self.shape[0]:
            raise RuntimeError(f"KV cache released with {self.shape[0] - len(self.free)} live sequences")
        freed = self.nbytes
        self.k, self.v = [], []
        return freed

    def reclaim_memory(self) -> None:
        """(Re)allocate the K/V tensors: at construction, and before a detached rank rejoins."""
        self.k = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def alloc(self) -> int:
        if not self.free:
            raise RuntimeError("KV cache has no free slot")
        s = self.free.pop()
        self.lengths[s] = 0
        return s

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def select(self, slots: list[int], new_tokens: list[int]) -> torch.Tensor:
        """The next forward covers `slots`, appending `new_tokens[i]` real tokens to slot i; returns
        the queries' absolute positions [B, S] (S = max(new_tokens)).

        The write positions, the key length and the attention mask are the same in every layer,
        so they are computed here once per forward rather than in each layer's `update`.
        """
        start = [self.lengths[s] for s in slots]
        if max(b + n for b, n in zip(start, new_tokens)) > self.max_len:
            raise RuntimeError(f"sequence longer than the KV cache's {self.max_len} positions")
        self._slots, self._new = list(slots), list(new_tokens)
        B, S = len(slots), max(new_tokens)
        self._L = max(start) + S
        # Query s of row b sits at absolute position start_b + s and sees keys 0..start_b + s.
        start_B1 = torch.tensor(start, device=self.device)[:, None]
        q_pos_BS = start_B1 + torch.arange(S, device=self.device)[None] if S > 1 else start_B1
        # Padding positions past a request's real tokens are written too, then masked and later
        # overwritten: cheaper than a ragged scatter, and never attended to.
        self._write_pos_BS = q_pos_BS.clamp(max=self.max_len - 1) if self._L > self.max_len else q_pos_BS
        self._mask_BSL = torch.arange(self._L, device=self.device)[None, None, :] <= q_pos_BS[:, :, None]
        # Slots s0, s0+1, ... in order (the usual case: slots are handed out lowest first and a
        # batch keeps its order) are read as a view, with no gather, and written with one scatter
        # along the position axis; only the path taken gets its index tensors.
        first = slots[0]
        self._run = slice(first, first + B) if slots == list(range(first, first + B)) else None
        if self._run is not None:
            G, C = self.k[0].shape[1], self.k[0].shape[3]
            self._write_idx_BGSC = self._write_pos_BS[:, None, :, None].expand(B, G, S, C)
        else:
            self._slots_B = torch.tensor(slots, device=self.device)
            self._write_b_BS = self._slots_B[:, None].expand(B, S)
        return q_pos_BS

    def commit(self) -> None:
        """After the forward: the appended tokens become part of each sequence."""
        for s, n in zip(self._slots, self._new):
            self.lengths[s] += n

    def update(self, layer: int, k_BGSC: torch.Tensor, v_BGSC: torch.Tensor):
        if self._run is not None:
            k_BGLC, v_BGLC = self.k[layer][self._run], self.v[layer][self._run]
            k_BGLC.scatter_(2, self._write_idx_BGSC, k_BGSC)
            v_BGLC.scatter_(2, self._write_idx_BGSC, v_BGSC)
            return k_BGLC[:, :, :self._L], v_BGLC[:, :, :self._L], self._mask_BSL
        self.k[layer][self._write_b_BS, :, self._write_pos_BS] = k_BGSC.transpose(1, 2)
        self.v[layer][self._write_b_BS, :, self._write_pos_BS] = v_BGSC.transpose(1, 2)
        # index_select copies whole rows; advanced indexing takes a slower generic path on CPU.
        k_BGLC = self.k[layer][:, :, :self._L].index_select(0, self._slots_B)
        v_BGLC = self.v[layer][:, :, :self._L].index_select(0, self._slots_B)
        return k_BGLC, v_BGLC, self._mask_BSL
