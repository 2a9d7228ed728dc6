"""The planner's estimate of a quorum schedule's release area, under a caller-supplied step cost.

`StepCost` is the whole interface between the planner and a cost model: the simulator passes its
calibrated model, the runtime may pass measured step times, and `ShapeCost` is the planner's own
default, a bandwidth-bound estimate from `ModelShape` alone.

The estimate is deliberately coarse: ranks decode all their responses concurrently, one token per
step, so a rank drains at the step of its longest response; a stage's step time is
`decode_step_s(b, c, |A_i|)` with the batch's initial mean per-rank size `b` and mean context `c`;
stage i+1 fires at the step its trigger ranks have drained, costs `shrink_s` on its old members, and
its leaving ranks are detached from then until the end. For every sample of the predicted lengths
this gives the rollout time T and the detached rank-seconds; the planner maximises
`detached - W * (T - T_static)`: release area net of any lengthening of the rollout (a slower
smaller group holds every rank of the synchronous job back), i.e. it minimises occupied
rank-seconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from elastic.shape import ModelShape


class StepCost(Protocol):
    def decode_step_s(self, batch_per_rank: int, context: int, ep_size: int) -> float:
        """Seconds of one synchronous decode step of an EP group of `ep_size` ranks, each with
        `batch_per_rank` live requests of mean context `context` tokens."""

    def shrink_s(self, experts_moved: int, ep_size: int) -> float:
        """Seconds a shrink takes that moves `experts_moved` experts out of a group of `ep_size`."""


@dataclass(frozen=True)
class ShapeCost:
    """Default step cost from the model shape (H100 figures; see ../shared/REFERENCES.md).

    A decode step reads the dense weights, the experts its tokens activate on this rank, and the
    live KV cache from HBM (`hbm_bytes_per_s`), plus two all-to-alls per MoE layer whose latency
    grows with log2 of the group size (DeepEP low-latency mode: ~0.1-0.3 ms per layer at EP 8-64,
    scaled down for Qwen3's smaller hidden size). A shrink moves every expert over one link
    (`link_bytes_per_s`, serialised: an upper bound) after a fixed routing-table swap.
    """

    shape: ModelShape = ModelShape()
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


def rank_drain_steps(lengths: np.ndarray, ranks_of: np.ndarray, ranks: int) -> np.ndarray:
    """(samples, responses) lengths -> (samples, ranks) step at which each rank drains."""
    out = np.zeros((lengths.shape[0], ranks))
    for r in range(ranks):
        cols = ranks_of == r
        if cols.any():
            out[:, r] = lengths[:, cols].max(axis=1)
    return out


@dataclass(frozen=True)
class Estimate:
    rollout_s: float
    static_s: float  # the same layout with nobody leaving
    detached_rank_s: float
    occupied_rank_s: float
    net_release_rank_s: float  # detached - W * (rollout_s - static_s): what the planner maximises


def estimate(drain: np.ndarray, sizes: Sequence[int], moves: Sequence[int],
             step_s: Sequence[float], shrink_s: Sequence[float]) -> Estimate:
    """Mean over samples of the timeline of a chain whose stage i keeps ranks 0..sizes[i]-1.

    `drain` is (samples, W) drain steps; `moves[i]`, `shrink_s[i]` belong to the shrink into stage
    i (entry 0 unused); `step_s[i]` is stage i's decode step time.
    """
    S, W = drain.shape
    # Ranks >= g have all drained when the suffix maximum from g is reached.
    suffix = np.maximum.accumulate(drain[:, ::-1], axis=1)[:, ::-1]
    end = suffix[:, 0]
    t = np.zeros(S)          # wall time at the current step position
    pos = np.zeros(S)        # current step position
    alive = np.ones(S, bool)  # the chain has not run past the end of the rollout
    detached_start = []
    for i in range(1, len(sizes)):
        fire = np.maximum(suffix[:, sizes[i]], pos)
        alive &= fire < end
        t = np.where(alive, t + (fire - pos) * step_s[i - 1] + shrink_s[i], t)
        pos = np.where(alive, fire, pos)
        detached_start.append((sizes[i - 1] - sizes[i], alive.copy(), t.copy()))
    # The last stage reached by each sample decodes to the end at its own step time.
    stage_at_end = np.zeros(S, int)
    for i, (_, a, _) in enumerate(detached_start, start=1):
        stage_at_end[a] = i
    T = t + (end - pos) * np.asarray(step_s)[stage_at_end]
    detached = np.zeros(S)
    for leavers, a, start in detached_start:
        detached += np.where(a, leavers * (T - start), 0.0)
    static = float((end * step_s[0]).mean())
    occupied = float((W * T - detached).mean())
    return Estimate(float(T.mean()), static, float(detached.mean()), occupied, W * static - occupied)
