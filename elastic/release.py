"""The planner's estimate of a quorum schedule's release area, under a caller-supplied step cost.

`StepCost` is the whole interface between the planner and a cost model: the simulator passes its
calibrated model, the runtime may pass measured step times, and `ShapeCost` is the planner's own
default, a bandwidth-bound estimate from `ModelShape` alone.

The estimate is deliberately coarse: ranks decode all their responses concurrently, one token per
step, so a rank drains at the step of its longest response; stage i+1 fires at the step its trigger
ranks have drained, costs `shrink_s` on its old members, and its leaving ranks are detached from
then until the end; a step costs `decode_step_s` at the live batch and mean context of
its segment (`Timeline`), for the busiest member. Over samples of the predicted lengths this gives the rollout time T and
the detached rank-seconds (the release area). The planner keeps the chain with the fewest occupied
rank-seconds `W * T - detached`, i.e. the largest release area net of any lengthening of the
rollout: a smaller group steps more slowly (each member reads more experts), and in a synchronous
job a longer rollout holds every rank back.
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


class Timeline:
    """One layout's sampled rollouts, cut into segments at every candidate stage's fire step.

    Ranks leave in `order` (the last to leave first): a stage of size g holds order[:g] and fires
    once order[g:] have all drained, so its fire step does not depend on the rest of the chain and
    every chain of the layout is priced on the same segments. A segment's step time comes from the
    live batch of the busiest rank and the mean context at its middle, for the group size active
    in it.
    """

    def __init__(self, lengths: np.ndarray, rank_of: np.ndarray, order: Sequence[int],
                 sizes: Sequence[int], prompt_mean: float, cost: StepCost):
        S, n = lengths.shape
        ranks = len(order)
        drain = rank_drain_steps(lengths, rank_of, ranks)[:, list(order)]
        suffix = np.maximum.accumulate(drain[:, ::-1], axis=1)[:, ::-1]
        self.ranks, self.cost = ranks, cost
        self.index = {g: k for k, g in enumerate(sizes, start=1)}
        self.end = suffix[:, 0]
        bounds = np.column_stack([np.zeros(S)] + [suffix[:, g] for g in sizes] + [self.end])
        self.bounds = bounds
        self.seg = np.diff(bounds, axis=1)
        mid = (bounds[:, :-1] + bounds[:, 1:]) / 2
        # The synchronous step waits for the member with the most live requests.
        flat = rank_of[None, :] + ranks * np.arange(S)[:, None]
        self.batch = np.array([
            np.bincount(flat[lengths > mid[:, k:k + 1]], minlength=S * ranks)
            .reshape(S, ranks).max(axis=1).mean()
            for k in range(mid.shape[1])])
        self.context = prompt_mean + mid.mean(axis=0)
        self._tau: dict[tuple[int, int], float] = {}

    def step_s(self, k: int, g: int) -> float:
        key = (k, g)
        if key not in self._tau:
            batch = max(1, round(self.batch[k]))
            self._tau[key] = self.cost.decode_step_s(batch, int(self.context[k]), g)
        return self._tau[key]

    def estimate(self, sizes: Sequence[int], shrink_s: Sequence[float]) -> Estimate:
        """Mean over samples of the chain `sizes` (W first); `shrink_s[i]` is the shrink into i."""
        S, K1 = self.seg.shape
        fire_at = {self.index[g]: i for i, g in enumerate(sizes[1:], start=1)}
        t = np.zeros(S)
        static = np.zeros(S)
        starts = []
        g = sizes[0]
        for k in range(K1):
            if k in fire_at:
                i = fire_at[k]
                fired = self.bounds[:, k] < self.end
                t = t + np.where(fired, shrink_s[i], 0.0)
                starts.append((sizes[i - 1] - sizes[i], fired, t.copy()))
                g = sizes[i]
            t = t + self.seg[:, k] * self.step_s(k, g)
            static = static + self.seg[:, k] * self.step_s(k, self.ranks)
        detached = np.zeros(S)
        for leavers, fired, start in starts:
            detached += np.where(fired, leavers * (t - start), 0.0)
        return Estimate(float(t.mean()), float(static.mean()), float(detached.mean()),
                        float((self.ranks * t - detached).mean()))
