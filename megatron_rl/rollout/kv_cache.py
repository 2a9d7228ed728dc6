"""A slot-based KV cache: one slot per live request, preallocated to the longest sequence.

Shapes: per layer, K and V of [slots, G, L_max, C]. A request keeps its slot from prefill to its last
token; a finished request's slot is freed and reused. `select(slots)` fixes which slots the next
forward covers, so a rank's batch can shrink (finished requests leave) without copying the cache.
"""
from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(self, num_layers: int, slots: int, groups: int, max_len: int, channels: int,
                 dtype: torch.dtype):
        shape = (slots, groups, max_len, channels)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self.max_len = max_len
        self.free = list(range(slots - 1, -1, -1))
        self._slots = torch.zeros(0, dtype=torch.long)
        self._new = torch.zeros(0, dtype=torch.long)

    def alloc(self) -> int:
        if not self.free:
            raise RuntimeError("KV cache has no free slot")
        s = self.free.pop()
        self.lengths[s] = 0
        return s

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def select(self, slots: list[int], new_tokens: list[int]) -> None:
        """The next forward covers `slots`, appending `new_tokens[i]` real tokens to slot i."""
        self._slots = torch.tensor(slots, dtype=torch.long)
        self._new = torch.tensor(new_tokens, dtype=torch.long)
        if (self.lengths[self._slots] + self._new).max().item() > self.max_len:
            raise RuntimeError(f"sequence longer than the KV cache's {self.max_len} positions")

    def commit(self) -> None:
        """After the forward: the appended tokens become part of each sequence."""
        self.lengths[self._slots] += self._new

    def update(self, layer: int, k_BGSC: torch.Tensor, v_BGSC: torch.Tensor):
        slots, start = self._slots, self.lengths[self._slots]
        B, _, S, _ = k_BGSC.shape
        pos_BS = start[:, None] + torch.arange(S)[None]
        # Padding positions past a request's real tokens are written too, then masked and later
        # overwritten: cheaper than a ragged scatter, and never attended to.
        pos_BS = pos_BS.clamp(max=self.max_len - 1)
        b_idx = slots[:, None].expand(B, S)
        self.k[layer][b_idx, :, pos_BS] = k_BGSC.transpose(1, 2)
        self.v[layer][b_idx, :, pos_BS] = v_BGSC.transpose(1, 2)
        L = int((start + S).max().item())
        k_BGLC = self.k[layer][slots, :, :L]
        v_BGLC = self.v[layer][slots, :, :L]
        # Query s of row b sits at absolute position start_b + s and sees keys 0..start_b + s.
        q_pos_BS = start[:, None] + torch.arange(S)[None]
        mask_BSL = torch.arange(L)[None, None, :] <= q_pos_BS[:, :, None]
        return k_BGLC, v_BGLC, mask_BSL
