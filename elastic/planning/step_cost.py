"""The step cost: the whole interface between the planner and a cost model.

`StepCost` is what the planner asks (seconds of a decode step, of a shrink): the simulator passes
its calibrated model, the runtime may pass measured step times, `ShapeCost` is the planner's own
default (a bandwidth-bound estimate from `ModelShape` alone) and `FixedCost` a measured constant.
`step_table` prices many steps at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from elastic.planning.shape import ModelShape


class StepCost(Protocol):
    def decode_step_s(self, batch_per_rank: int, context: int, ep_size: int) -> float:
        """Seconds of one synchronous decode step of an EP group of `ep_size` ranks, each with
        `batch_per_rank` live requests of mean context `context` tokens."""

    def shrink_s(self, experts_moved: int, ep_size: int) -> float:
        """Seconds a shrink takes that moves `experts_moved` experts out of a group of `ep_size`."""


def step_table(cost: StepCost, batch: np.ndarray, context: np.ndarray, ep_size: int) -> np.ndarray:
    """`cost.decode_step_s` of every (batch[k], context[k]) in a group of `ep_size`: one call on
    the arrays for a cost model that broadcasts (`takes_arrays = True`, the simulator's), else one
    call per entry. The planner prices thousands of these per plan."""
    if getattr(cost, "takes_arrays", False):
        out = np.asarray(cost.decode_step_s(batch, context, ep_size), dtype=np.float64)
        return np.broadcast_to(out, np.shape(batch)).copy()
    return np.array([cost.decode_step_s(int(b), int(c), ep_size)
                     for b, c in zip(np.ravel(batch).tolist(), np.ravel(context).tolist())],
                    dtype=np.float64).reshape(np.shape(batch))


@dataclass(frozen=True)
class ShapeCost:
    """Default step cost from the model shape (H100 figures; the shape's in planning/shape.py).

    A decode step reads the dense weights, the experts its tokens activate on this rank, and the
    live KV cache from HBM (`hbm_bytes_per_s`), plus two all-to-alls per MoE layer whose latency
    grows with log2 of the group size (DeepEP low-latency mode: ~0.1-0.3 ms per layer at EP 8-64,
    scaled down for Qwen3's smaller hidden size). A shrink moves every expert over one link
    (`link_bytes_per_s`, serialised: an upper bound) after a fixed routing-table swap.
    """

    shape: ModelShape = field(default_factory=ModelShape)
    hbm_bytes_per_s: float = 3.35e12
    a2a_base_s: float = 30e-6
    a2a_per_log2_s: float = 10e-6
    link_bytes_per_s: float = 100e9
    shrink_fixed_s: float = 0.05

    def decode_step_s(self, batch_per_rank: int, context: int, ep_size: int) -> float:
        s = self.shape
        tokens = max(batch_per_rank, 0) * ep_size
        active = s.num_experts * (1.0 - (1.0 - s.topk / s.num_experts) ** tokens)
        per_rank = active / ep_size
        nbytes = (s.dense_bytes + per_rank * s.expert_bytes
                  + batch_per_rank * context * s.kv_bytes_per_token)
        a2a = 2 * s.num_layers * (self.a2a_base_s + self.a2a_per_log2_s * math.log2(ep_size)) \
            if ep_size > 1 else 0.0
        return nbytes / self.hbm_bytes_per_s + a2a

    def shrink_s(self, experts_moved: int, ep_size: int) -> float:
        return self.shrink_fixed_s + experts_moved * self.shape.expert_bytes / self.link_bytes_per_s

    def migrate_s(self, kv_bytes: float, ep_size: int) -> float:
        """Moving live requests' KV cache over the same link (online re-planning); `kv_bytes` is
        what the busiest rank sends or receives."""
        return float(kv_bytes) / self.link_bytes_per_s


@dataclass(frozen=True)
class FixedCost:
    """A step cost that does not depend on the group: a measured mean decode step and shrink.

    For engines whose step time is dominated by fixed overheads (the CPU engine of the tests),
    where `ShapeCost`'s H100 figures would make every shrink look too dear to plan.
    """

    step_s: float
    shrink_fixed_s: float = 0.0

    def decode_step_s(self, batch_per_rank: int, context: int, ep_size: int) -> float:
        return self.step_s

    def shrink_s(self, experts_moved: int, ep_size: int) -> float:
        return self.shrink_fixed_s
