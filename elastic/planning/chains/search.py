"""The search over quorum chains: given what `make_plan` believes about the batch's lengths, which
chain of group sizes (W down to the floor) to run, and under which layout.

Apart from planner.py because it is the planner's one combinatorial step: `make_plan` decides the
inputs (predicted lengths, KV demand, the floor the memory allows), `ChainSearch` prices chains
against them (`chains.estimate.ChainTimeline`) and keeps the best by an objective (`objective_key`),
which the online rule (`online.rule.OnlineRule`) and the simulator's policies compare by as well.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from elastic.planning import layout as layouts
from elastic.planning.chains.estimate import ChainTimeline, rank_drain_steps
from elastic.planning.chains.schedule import build_stages, candidate_sizes, chains, held_counts
from elastic.planning.choices import OBJECTIVES
from elastic.planning.memory.kv import Demand, RankKV
from elastic.planning.plan import Plan, PlanError
from elastic.planning.platform import Platform

# How chains are compared (smaller first), for each of `choices.OBJECTIVES`. `occupied`: fewest
# occupied rank-seconds, the largest release area net of lengthening (capacity-oriented);
# `rollout`: shortest rollout, then the largest release area (latency-oriented). Ties go to the
# larger release area.
_OBJECTIVE_KEYS = {
    "occupied": lambda r: (round(r[0].occupied_rank_s, 6), -r[0].detached_rank_s),
    "rollout": lambda r: (round(r[0].rollout_s, 6), -r[0].detached_rank_s),
}


def objective_key(objective: str):
    """The sort key of scored chains under `objective` (one of `choices.OBJECTIVES`)."""
    if objective not in _OBJECTIVE_KEYS:
        raise PlanError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {objective!r}")
    return _OBJECTIVE_KEYS[objective]


@dataclass(frozen=True)
class BatchBeliefs:
    """What `make_plan` believes about the batch, as chains are priced on it: the responses' keys
    (batch order), the work each is placed by (its median length) and the tokens reserved for it,
    the batch's KV demand, samples of the lengths (samples, responses), and the mean prompt length."""

    keys: list[tuple[str, int]]
    work: np.ndarray
    reserve: np.ndarray
    demand: Demand
    samples: np.ndarray
    prompt_mean: float


class ChainSearch:
    """Prices quorum chains for one batch and finds the one with the fewest occupied rank-seconds:
    every chain when there are at most `EXHAUSTIVE`, else the one-stage chain against a hill climb
    (toggling one candidate size at a time while that helps) from the deepest chain."""

    EXHAUSTIVE = 16

    def __init__(self, beliefs: BatchBeliefs, platform: Platform, floor: int, layout: str, objective: str,
                 queued: bool = False):
        """`queued`: the batch is known not to fit the KV cache at once, and the run's cache admits
        what fits and queues the rest (`KVUnit.queues`): place it with no KV check."""
        dims = platform.dims
        self.keys, self.work, self.demand, self.samples = beliefs.keys, beliefs.work, beliefs.demand, beliefs.samples
        self.queued = queued
        self.prompt_mean, self.ranks, self.floor, self.cost = beliefs.prompt_mean, dims.world, floor, platform.cost
        self.budget = platform.budget
        self.dims, self.E = dims, dims.experts
        self.key = objective_key(objective)
        self.order = layouts.placement_order(beliefs.reserve, beliefs.work)
        self.cands = candidate_sizes(dims, floor) if floor < dims.world else []
        self.cache: dict[tuple[int, ...], tuple | None] = {}
        self.stage_memo: dict = {}
        self.move_memo: dict[tuple[int, ...], int] = {}
        self.feasible, self.reasons = 0, []
        self.fixed = self.timeline = None
        self.leave_order = list(range(dims.world))
        place_once = layouts.layout_kind(layout).place_once
        if place_once is not None:
            self._place_baseline(place_once)

    def _place_baseline(self, place_once) -> None:
        # The baselines place once, under the full world's budgets; the chain only decides who
        # stays, in the order the ranks are predicted to drain (latest stays longest).
        kv = RankKV(self.demand, self._budgets(build_stages([self.ranks], self.E)))
        try:
            self.fixed = place_once(self.keys, self.order, self.work, self.ranks, kv)
        except PlanError as e:
            raise PlanError(f"{e} (on all {self.ranks} ranks, before any shrink)") from None
        drain = rank_drain_steps(self.samples, np.array(self.fixed), self.ranks).mean(axis=0)
        self.leave_order = sorted(range(self.ranks), key=lambda r: (-drain[r], r))
        self.timeline = self._timeline(self.fixed)

    def _timeline(self, rank_of) -> ChainTimeline:
        return ChainTimeline(self.samples, np.array(rank_of), self.leave_order, self.cands,
                        self.prompt_mean, self.cost)

    def _budgets(self, stages) -> list[float]:
        """KV positions each rank may hold: the least over the stages it is a member of. A stage
        whose experts alone overflow a member (uneven or replicated ownership) is infeasible."""
        budget = [math.inf] * self.ranks
        for i, st in enumerate(stages):
            for r, h in held_counts(st.owners, st.members).items():
                room = self.budget.kv_budget_bytes(h)
                if room < 0:
                    raise PlanError(f"stage {i}: rank {r} would hold {h} experts, more than its "
                                    f"memory takes ({self.budget.describe(h)})")
                budget[r] = min(budget[r], room // self.budget.kv_bytes_per_token)
        return [math.inf] * self.ranks if self.queued else budget

    def price(self, sizes: tuple[int, ...]):
        """(estimate, sizes, stages, rank_of) of a chain, or None if its layout cannot fit."""
        if sizes in self.cache:
            return self.cache[sizes]
        stages = build_stages(list(sizes), self.E, self.leave_order, self.stage_memo, self.dims.ownership)
        result = None
        try:
            kv = RankKV(self.demand, self._budgets(stages))
            if self.fixed is not None:
                rank_of = self.fixed
                layouts.check_kv(rank_of, kv)
            else:
                rank_of = layouts.planned(self.order, self.work, tiers(list(sizes)), kv, self.keys)
        except PlanError as e:
            self.reasons.append(f"chain {list(sizes)}: {e}")
        else:
            self.feasible += 1
            chain = Plan(self.ranks, self.floor, self.E, "", False, [], stages)
            shrink = [0.0]
            for i in range(1, len(sizes)):
                # A shrink's moves depend only on the chain up to it: share them across chains.
                if sizes[:i + 1] not in self.move_memo:
                    self.move_memo[sizes[:i + 1]] = len(chain.transfers(i - 1, i))
                shrink.append(self.cost.shrink_s(self.move_memo[sizes[:i + 1]], sizes[i - 1]))
            est = (self.timeline or self._timeline(rank_of)).estimate(sizes, shrink)
            result = (est, list(sizes), stages, rank_of)
        self.cache[sizes] = result
        return result

    def best(self):
        if 2 ** len(self.cands) <= self.EXHAUSTIVE:
            found = [self.price(tuple(c)) for c in chains(self.dims, self.floor)]
        else:
            found = [self._score(frozenset()), self._climb(frozenset(self.cands))]
        found = [f for f in found if f is not None]
        if not found:
            raise PlanError(f"no quorum schedule from {self.ranks} ranks down to floor "
                            f"{self.floor} fits the KV cache; {self.reasons[0]}")
        return min(found, key=self.key)

    def _score(self, subset: frozenset):
        return self.price((self.ranks, *sorted(subset, reverse=True)))

    def _climb(self, start: frozenset):
        current, here = start, self._score(start)
        improved = True
        while improved:
            improved = False
            for c in self.cands:
                there = self._score(current ^ {c})
                if there is not None and (here is None or self.key(there) < self.key(here)):
                    current, here, improved = current ^ {c}, there, True
        return here


def tiers(sizes: list[int]) -> list[list[int]]:
    """Ranks grouped by the stage they leave at, residents (the last stage's members) first."""
    tiers = [list(range(sizes[-1]))]
    for i in range(len(sizes) - 1, 0, -1):
        tiers.append(list(range(sizes[i], sizes[i - 1])))
    return tiers
