"""A forward's MoE route rows: where each of its token rows' routes go in the rollout's route buffer
(models/routes.py `RouteSink`, one row per KV slot and position: `slot x max_len + position`).

Each layer's router writes its T rows' top-k there (`RouteRows.of(T)`). A decode forward's rows are
its batch rows in order, computed on the device from the decode step's static inputs (a captured
CUDA graph writes them too); a layer fed only the real rows gets the leading ones, as padding rows
come last. A prefill's are its B x S rows, or, T smaller, only its real tokens in row order
(megatron-core's block gets `h[token_mask]`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeRows:
    slot_B: torch.Tensor
    pos_B: torch.Tensor
    max_len: int

    @functools.cached_property
    def rows_B(self) -> torch.Tensor:
        return self.slot_B * self.max_len + self.pos_B

    def of(self, T: int) -> torch.Tensor:
        return self.rows_B[:T]


@dataclass(frozen=True)
class PrefillRows:
    slots: list[int]
    new: list[int]  # real tokens per row
    S: int  # positions per row, padding included
    max_len: int
    device: torch.device

    @functools.cached_property
    def padded_T(self) -> torch.Tensor:
        return torch.tensor([s * self.max_len + p for s in self.slots for p in range(self.S)], device=self.device)

    @functools.cached_property
    def real_T(self) -> torch.Tensor:
        return torch.tensor([s * self.max_len + p for s, n in zip(self.slots, self.new) for p in range(n)],
                            device=self.device)

    def of(self, T: int) -> torch.Tensor:
        return self.padded_T if T == len(self.slots) * self.S else self.real_T
