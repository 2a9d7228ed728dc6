"""The planner's estimate of a quorum schedule's release area, under a caller-supplied step cost.

The step cost (`StepCost` and its implementations) is elastic/planning/step_cost.py.

The estimate is deliberately coarse: ranks decode all their responses concurrently, one token per
step, so a rank drains at the step of its longest response; stage i+1 fires at the step its trigger
ranks have drained, costs `shrink_s` on its old members, and its leaving ranks are detached from
then until the end; a step costs `decode_step_s` at the busiest member's live batch and the mean
context of its segment (`ChainTimeline`). Over samples of the predicted lengths this gives the rollout
time T and the detached rank-seconds (the release area). By default the planner keeps the chain
with the fewest occupied rank-seconds `W * T - detached`, i.e. the largest release area net of any
lengthening of the rollout: a smaller group may step more slowly (each member reads more experts),
and in a synchronous job a longer rollout holds every rank back.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elastic.planning.plan import Plan
from elastic.planning.step_cost import StepCost, step_table


def rank_drain_steps(lengths: np.ndarray, ranks_of: np.ndarray, ranks: int) -> np.ndarray:
    """(samples, responses) lengths -> (samples, ranks) step at which each rank drains."""
    out = np.zeros((lengths.shape[0], ranks))
    order = np.argsort(ranks_of, kind="stable")
    present, starts = np.unique(ranks_of[order], return_index=True)
    if len(present):
        out[:, present] = np.maximum.reduceat(lengths[:, order], starts, axis=1)
    return out


@dataclass(frozen=True)
class Estimate:
    rollout_s: float
    static_s: float  # the same layout with nobody leaving
    detached_rank_s: float
    occupied_rank_s: float


class ChainTimeline:
    """One layout's sampled rollouts, cut into segments priced at their own step time.

    Ranks leave in `order` (the last to leave first): a stage of size g holds order[:g] and fires
    once order[g:] have all drained, so its fire step does not depend on the rest of the chain and
    every chain of the layout is priced on the same segments: those between the fire steps of
    every candidate size and `PIECES` equal slices of the rollout. A segment's step costs
    `decode_step_s` at the live batch of the busiest rank and the mean context at its middle (mean
    over samples), for the group size active in it.
    """

    PIECES = 16

    def __init__(self, lengths: np.ndarray, rank_of: np.ndarray, order: Sequence[int],
                 sizes: Sequence[int], prompt_mean: float, cost: StepCost):
        S = lengths.shape[0]
        ranks = len(order)
        drain = rank_drain_steps(lengths, rank_of, ranks)[:, list(order)]
        self.suffix = np.maximum.accumulate(drain[:, ::-1], axis=1)[:, ::-1]
        self.ranks, self.cost = ranks, cost
        self.end = self.suffix[:, 0]
        slices = self.end[:, None] * (np.arange(self.PIECES + 1) / self.PIECES)[None, :]
        fires = self.suffix[:, list(sizes)] if len(sizes) else np.zeros((S, 0))
        self.bounds = np.sort(np.concatenate([slices, fires], axis=1), axis=1)
        self.seg = np.diff(self.bounds, axis=1)
        mid = (self.bounds[:, :-1] + self.bounds[:, 1:]) / 2
        # The synchronous step waits for the member with the most live requests.
        by_rank = np.argsort(rank_of, kind="stable")
        _, starts = np.unique(rank_of[by_rank], return_index=True)
        alive = lengths[:, by_rank][:, None, :] > mid[:, :, None]  # (S, K, n)
        live = np.add.reduceat(alive, starts, axis=2, dtype=np.int32)  # (S, K, ranks present)
        self.batch = live.max(axis=2).mean(axis=0)
        self.context = prompt_mean + mid.mean(axis=0)
        self._tau: dict[int, np.ndarray] = {}

    def steps_s(self, g: int) -> np.ndarray:
        """(K,) step seconds of every segment in a group of g."""
        if g not in self._tau:
            self._tau[g] = step_table(self.cost, np.maximum(np.rint(self.batch), 1),
                                      self.context.astype(np.int64), g)
        return self._tau[g]

    def estimate(self, sizes: Sequence[int], shrink_s: Sequence[float]) -> Estimate:
        """Mean over samples of the chain `sizes` (W first); `shrink_s[i]` is the shrink into i."""
        S, K = self.seg.shape
        # Stage i fires at its trigger's drain step, unless the rollout ends there; fire steps
        # grow with i (each trigger includes the previous ones' ranks).
        fire = np.column_stack([self.suffix[:, g] for g in sizes[1:]]) if len(sizes) > 1 \
            else np.zeros((S, 0))
        fired = fire < self.end[:, None]
        # Stages active in each segment: those fired at or before the segment's start.
        active = np.sum(fired[:, None, :] & (fire[:, None, :] <= self.bounds[:, :K, None]), axis=2)
        tau = np.column_stack([self.steps_s(g) for g in sizes])  # (K, stages)
        step_time = self.seg * tau[np.arange(K)[None, :], active]
        static = float((self.seg * tau[:, 0][None, :]).sum(axis=1).mean())  # sizes[0] is W
        shrink = np.asarray(shrink_s[1:], float)[None, :] * fired  # (S, stages - 1)
        T = step_time.sum(axis=1) + shrink.sum(axis=1)
        # Time at each fire step, plus every shrink up to and including this one.
        cum = np.concatenate([np.zeros((S, 1)), np.cumsum(step_time, axis=1)], axis=1)
        at = np.sum(self.bounds[:, :, None] < fire[:, None, :], axis=1)  # bound index of fire
        start = np.take_along_axis(cum, at, axis=1) + np.cumsum(shrink, axis=1)
        leavers = -np.diff(np.asarray(sizes, float))[None, :]
        detached = np.sum(np.where(fired, leavers * (T[:, None] - start), 0.0), axis=1)
        return Estimate(float(T.mean()), static, float(detached.mean()),
                        float((self.ranks * T - detached).mean()))


def replay(plan: Plan, lengths: dict[tuple[str, int], int], prompt_mean: float,
           cost: StepCost) -> Estimate:
    """The same estimate for a finished plan on known lengths (one sample): how the planner would
    score `plan` had it known the truth. Used to compare plans side by side on a trace."""
    keys = [(a.prompt_id, a.sample) for a in plan.assignments]
    rank_of = np.array([a.rank for a in plan.assignments])
    exact = np.array([[lengths[k] for k in keys]], float)
    # Leaving order: the last stage's members first, the first leavers last.
    order = list(plan.stages[-1].members)
    for st in reversed(plan.stages[1:]):
        order += list(st.drained)
    sizes = [len(st.members) for st in plan.stages]
    shrink = [0.0] + [cost.shrink_s(len(plan.transfers(i - 1, i)), sizes[i - 1])
                      for i in range(1, len(sizes))]
    return ChainTimeline(exact, rank_of, order, sizes[1:], prompt_mean, cost).estimate(sizes, shrink)
