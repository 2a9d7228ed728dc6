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
        """The next forward covers `slots`, appending `new_tokens[i]` real tokens to slot i.

        The write positions, the key length and the attention mask are the same in every layer,
        so they are computed here once per forward rather than in each layer's `update`.
        """
        self._slots = torch.tensor(slots, dtype=torch.long)
        self._new = torch.tensor(new_tokens, dtype=torch.long)
        start = self.lengths[self._slots]
        if (start + self._new).max().item() > self.max_len:
            raise RuntimeError(f"sequence longer than the KV cache's {self.max_len} positions")
        B, S = len(slots), max(new_tokens)
        # Query s of row b sits at absolute position start_b + s and sees keys 0..start_b + s.
        q_pos_BS = start[:, None] + torch.arange(S)[None]
        # Padding positions past a request's real tokens are written too, then masked and later
        # overwritten: cheaper than a ragged scatter, and never attended to.
        self._write_pos_BS = q_pos_BS.clamp(max=self.max_len - 1)
        self._write_b_BS = self._slots[:, None].expand(B, S)
        self._L = int((start + S).max().item())
        self._mask_BSL = torch.arange(self._L)[None, None, :] <= q_pos_BS[:, :, None]

    def commit(self) -> None:
        """After the forward: the appended tokens become part of each sequence."""
        self.lengths[self._slots] += self._new

    def update(self, layer: int, k_BGSC: torch.Tensor, v_BGSC: torch.Tensor):
        self.k[layer][self._write_b_BS, :, self._write_pos_BS] = k_BGSC.transpose(1, 2)
        self.v[layer][self._write_b_BS, :, self._write_pos_BS] = v_BGSC.transpose(1, 2)
        # index_select copies whole rows; advanced indexing takes a slower generic path on CPU.
        k_BGLC = self.k[layer][:, :, :self._L].index_select(0, self._slots)
        v_BGLC = self.v[layer][:, :, :self._L].index_select(0, self._slots)
        return k_BGLC, v_BGLC, self._mask_BSL
