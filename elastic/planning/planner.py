"""`make_plan`: the one entry point the runtime and the simulator call.

Order of decisions (each step documented in its own module):
1. predict every response's length from the history (`predict.Predictor`, epochs before the batch
   only) or take the true lengths (`true_lengths`, the `oracle` policy);
2. size each response's KV by a length distribution (`kv.Demand`): TailGuard's calibrated one
   (`guard.TailGuard`) with `tailguard=True`, the predictor's own without it, the true length for
   the oracle; its reserved length (the bound, or the (1 - alpha) quantile) orders placement;
3. price the floor against the device's memory budget (`shape.MemoryBudget`: weights, experts
   held, resident state, KV): reject a floor that cannot hold every expert, and raise one whose
   ranks would have no room left for the largest response's KV cache (`_memory_floor`);
4. for every quorum chain from W down to at least the floor (`schedule.chains`), build its stages,
   the per-rank KV budgets at the tightest stage each rank belongs to, and the layout under those
   budgets (`natural` and `lengthsort` place once and only check); drop chains whose layout cannot
   fit; price the rest over samples of the predictive distribution (`chain_estimate.ChainTimeline`) and keep
   the one with the fewest occupied rank-seconds (the largest release area net of lengthening;
   `objective="rollout"` keeps the shortest predicted rollout instead);
5. with `ownership="blocks"` (the megatron backend) every stage is megatron-core's contiguous
   blocks, so only group sizes that divide the expert count are candidates (`schedule` module doc);
6. with a weak predictor (the prompt explains under `WEAK_ICC` of the length variance), `planned`
   places like `lengthsort`: residency built on noise would only concentrate random long responses.

`floor == ranks` gives the single-stage plan (nobody leaves): `vanilla` is `natural` with it,
`lengthsort` the same with `layout="lengthsort"`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from elastic.planning import layout as layouts
from elastic.planning.chain_estimate import ChainTimeline, rank_drain_steps
from elastic.planning.dims import LayoutError, ParallelDims
from elastic.planning.guard import TailGuard
from elastic.planning.kv import Demand, RankKV
from elastic.planning.partial import conditioned
from elastic.planning.plan import Assignment, Plan, PlanError
from elastic.planning.predict import LengthDist, Predictor
from elastic.planning.schedule import build_stages, candidate_sizes, chains, held_counts
from elastic.planning.shape import MemoryBudget, ModelShape
from elastic.planning.step_cost import FixedCost, ShapeCost, StepCost
from elastic.trace import Trace

__all__ = ["LAYOUTS", "OBJECTIVES", "FixedCost", "PlanError", "ShapeCost", "StepCost", "make_plan", "plan_epoch"]

LAYOUTS = ("natural", "lengthsort", "planned")
WEAK_ICC = 0.1
# Length samples the release estimate averages over: 32 for a 1,024-response batch, fewer for
# larger batches, whose many ranks average out on their own.
SAMPLES = (8, 32)


class BatchItem(Protocol):
    prompt_id: str
    sample: int
    prompt_len: int


def make_plan(batch: Sequence[BatchItem], history: Trace, *, ranks: int, floor: int,
              shape: ModelShape, layout: str, tailguard: bool, alpha: float = 0.05,
              cost: StepCost | None = None,
              true_lengths: dict[tuple[str, int], int] | None = None,
              max_response_len: int | None = None, seed: int = 0,
              objective: str = "occupied", budget: MemoryBudget | None = None,
              ownership: str = "balanced", known_prefix: dict[tuple[str, int], int] | None = None) -> Plan:
    """Plan one rollout of `batch` (data order) on `ranks` ranks; see the module docstring.

    Only `prompt_id`, `sample` and `prompt_len` of the batch are read. `max_response_len` is the
    generation cap; it is inferred from truncated history records when omitted, and is required
    when the history is empty (nothing else bounds a response's KV then). `budget`: the device
    memory every check prices weights, experts and KV against (default: `shape.budget`).
    `known_prefix`: the tokens so far of responses carried over from an earlier rollout (partial
    rollouts); their `prompt_len` counts those tokens (they are re-prefilled), and they are planned
    by what is left of them (`partial.conditioned`: the length given it exceeds the tokens so far).
    """
    dims = _validate(batch, ranks, floor, shape, layout, alpha, objective, ownership)
    cost = cost or ShapeCost(shape)
    budget = budget or shape.budget
    keys = [(b.prompt_id, b.sample) for b in batch]
    prompt_len = np.array([b.prompt_len for b in batch], float)
    E = shape.num_experts

    if true_lengths is not None:
        missing = [k for k in keys if k not in true_lengths]
        if missing:
            raise PlanError(f"true_lengths lacks {len(missing)} responses of the batch, e.g. {missing[0]}")
        truth = np.array([true_lengths[k] for k in keys], float)
        dists = [LengthDist(math.log1p(x), 0.0, None, True) for x in truth]
        reserve, work, weak, tail_floor = truth, truth, False, 0.0
        meta = {"predictor": "oracle"}
        kv_dists = dists
    else:
        pred = Predictor(history, cap=max_response_len)
        if pred.empty and pred.cap is None:
            raise PlanError("no length history and no max_response_len: nothing bounds a "
                            "response's KV cache "
                            "(pass the generation cap: max_response_len, `flexfloor plan --max-response-len`)")
        dists = pred.predict_batch(batch)
        work = np.array([d.median for d in dists])
        if tailguard:
            guard = TailGuard.fit(history, alpha, cap=pred.cap)
            reserve = np.array([guard.bound(d) for d in dists])
            kv_dists, tail_floor = [guard.guarded(d) for d in dists], guard.tail_floor
        else:
            guard = None
            reserve = np.array([d.quantile(1 - alpha) for d in dists])
            kv_dists, tail_floor = dists, 0.0
        if known_prefix:
            given = [known_prefix.get(k, 0) for k in keys]
            dists = [conditioned(d, t) for d, t in zip(dists, given)]
            kv_dists = [conditioned(d, t) for d, t in zip(kv_dists, given)]
            work = np.array([d.median for d in dists])
            capped = guard is not None and math.isinf(guard.margin)  # every bound is the cap
            reserve = np.array([r if not t else float(kd.cap) if capped and kd.cap else kd.quantile(1 - alpha)
                                for r, t, kd in zip(reserve, given, kv_dists)])
        weak = pred.empty or pred.icc < WEAK_ICC
        meta = {"predictor": {"icc": round(pred.icc, 4), "weak": weak, "cap": pred.cap,
                              "history_records": len(history)}}
        if guard is not None:
            meta["tailguard"] = {"alpha": alpha, "margin": guard.margin_or_none,
                                 "calibrated_on": guard.calibrated_on}

    # The longest response's bound, in tokens: the runtime turns it into the predicted restoration
    # time that caps every lease.
    meta["predicted_max_len"] = float(reserve.max()) if len(reserve) else 0.0
    demand = Demand(kv_dists, prompt_len, alpha, tail_floor)
    floor = _memory_floor(floor, ranks, E, budget, demand, shape.name, meta)

    effective = "lengthsort" if layout == "planned" and weak else layout
    if effective != layout:
        meta["fallback"] = (f"planned placed as lengthsort: the prompt explains "
                            f"{meta['predictor']['icc']:.1%} of length variance (< {WEAK_ICC:.0%})")
    search = _ChainSearch(keys, work, reserve, demand,
                          _samples(dists, true_lengths is not None, seed), float(prompt_len.mean()),
                          dims, floor, shape, budget, effective, cost, objective)
    est, sizes, stages, rank_of = search.best()
    meta.update({
        "chain": sizes, "chains_feasible": search.feasible, "chains_priced": len(search.cache),
        "effective_layout": effective, "predicted_rollout_s": est.rollout_s,
        "predicted_static_rollout_s": est.static_s,
        "predicted_occupied_rank_s": est.occupied_rank_s,
        "leave_order": search.leave_order,
    })
    plan = Plan(ranks=ranks, floor=floor, num_experts=E, layout=layout, tailguard=tailguard,
                assignments=[Assignment(pid, s, r) for (pid, s), r in zip(keys, rank_of)],
                stages=stages, predicted_release_rank_s=est.detached_rank_s, meta=meta, ownership=dims.ownership)
    plan.check(keys)
    return plan


def _memory_floor(floor: int, ranks: int, E: int, budget: MemoryBudget, demand: Demand, name: str,
                  meta: dict) -> int:
    """The floor the chains may go down to, priced against the device's memory budget.

    A floor whose ranks cannot hold their share of the experts (beside the dense weights and any
    resident state) is refused, naming the smallest floor that can. A floor whose ranks hold the
    experts but then lack room for the KV cache of the batch's largest single response (its demand
    peak, `kv.Demand`) is raised to the smallest floor that has it, and `meta["floor_raised"]` says
    why: the last stage's residents are where the longest responses end.
    """
    def fits_experts(f: int) -> bool:
        return budget.kv_budget_bytes(math.ceil(E / f)) > 0

    if not fits_experts(floor):
        smallest = next((f for f in range(floor, ranks + 1) if fits_experts(f)), None)
        hint = (f"; the smallest floor that holds them is {smallest}" if smallest is not None
                else f"; not even all {ranks} ranks hold them")
        raise PlanError(f"floor {floor} cannot hold the {E} experts of {name}: a rank would hold "
                        f"{budget.describe(math.ceil(E / floor))}{hint}")
    need = float(demand.own_peaks().max()) * budget.kv_bytes_per_token
    raised = next((f for f in range(floor, ranks) if budget.kv_budget_bytes(math.ceil(E / f)) >= need), ranks)
    if raised != floor:
        held = math.ceil(E / floor)
        meta["floor_raised"] = (
            f"floor {floor} raised to {raised}: at floor {floor} a rank holds "
            f"{budget.describe(held)}, leaving {budget.kv_budget_bytes(held) / 1e9:.2f} GB for KV, "
            f"less than the largest response's {need / 1e9:.2f} GB")
    return raised


class _ChainSearch:
    """Prices quorum chains for one batch and finds the one with the fewest occupied rank-seconds:
    every chain when there are at most `EXHAUSTIVE`, else the one-stage chain against a hill climb
    (toggling one candidate size at a time while that helps) from the deepest chain."""

    EXHAUSTIVE = 16

    def __init__(self, keys, work, reserve, demand, samples, prompt_mean, dims, floor, shape,
                 budget, layout, cost, objective):
        self.keys, self.work, self.demand, self.samples = keys, work, demand, samples
        self.prompt_mean, self.ranks, self.floor, self.shape, self.cost = (
            prompt_mean, dims.world, floor, shape, cost)
        self.budget = budget
        self.dims, self.E = dims, dims.experts
        self.key = OBJECTIVES[objective]
        self.order = layouts.placement_order(reserve, work)
        self.cands = candidate_sizes(dims, floor) if floor < dims.world else []
        self.cache: dict[tuple[int, ...], tuple | None] = {}
        self.stage_memo: dict = {}
        self.move_memo: dict[tuple[int, ...], int] = {}
        self.feasible, self.reasons = 0, []
        self.fixed = self.timeline = None
        self.leave_order = list(range(dims.world))
        if layout != "planned":
            self._place_baseline(layout)

    def _place_baseline(self, layout: str) -> None:
        # The baselines place once, under the full world's budgets; the chain only decides who
        # stays, in the order the ranks are predicted to drain (latest stays longest).
        kv = RankKV(self.demand, self._budgets(build_stages([self.ranks], self.E)))
        try:
            if layout == "natural":
                index = {k: i for i, k in enumerate(self.keys)}
                self.fixed = [0] * len(self.keys)
                for a in layouts.natural(self.keys, self.ranks):
                    self.fixed[index[(a.prompt_id, a.sample)]] = a.rank
                layouts.check_kv(self.fixed, kv)
            else:
                self.fixed = layouts.lengthsort(self.order, self.work, self.ranks, kv, self.keys)
        except PlanError as e:
            raise PlanError(f"{e} (on all {self.ranks} ranks, before any shrink)") from None
        drain = rank_drain_steps(self.samples, np.array(self.fixed), self.ranks).mean(axis=0)
        self.leave_order = sorted(range(self.ranks), key=lambda r: (-drain[r], r))
        self.timeline = self._timeline(self.fixed)

    def _timeline(self, rank_of) -> ChainTimeline:
        return ChainTimeline(self.samples, np.array(rank_of), self.leave_order, self.cands,
                        self.prompt_mean, self.cost)

    def _budgets(self, stages) -> list[float]:
        """KV tokens each rank may hold: the least over the stages it is a member of. A stage
        whose experts alone overflow a member (uneven or replicated ownership) is infeasible."""
        budget = [math.inf] * self.ranks
        for i, st in enumerate(stages):
            for r, h in held_counts(st.owners, st.members).items():
                room = self.budget.kv_budget_bytes(h)
                if room < 0:
                    raise PlanError(f"stage {i}: rank {r} would hold {h} experts, more than its "
                                    f"memory takes ({self.budget.describe(h)})")
                budget[r] = min(budget[r], room // self.budget.kv_bytes_per_token)
        return budget

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
                rank_of = layouts.planned(self.order, self.work, _tiers(list(sizes)), kv, self.keys)
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


# How chains are compared (smaller first). `occupied`: fewest occupied rank-seconds, the largest
# release area net of lengthening (capacity-oriented); `rollout`: shortest rollout, then the
# largest release area (latency-oriented). Ties go to the larger release area.
OBJECTIVES = {
    "occupied": lambda r: (round(r[0].occupied_rank_s, 6), -r[0].detached_rank_s),
    "rollout": lambda r: (round(r[0].rollout_s, 6), -r[0].detached_rank_s),
}


def plan_epoch(trace: Trace, epoch: int, **kw) -> Plan:
    """Plan epoch `epoch` of a trace from the epochs before it (the history a live run would have)."""
    batch = trace.epoch(epoch)
    if kw.pop("oracle", False):
        kw["true_lengths"] = {r.key: r.response_len for r in batch}
    return make_plan(batch, trace.before(epoch), **kw)


def _validate(batch, ranks, floor, shape, layout, alpha, objective, ownership) -> ParallelDims:
    """The inputs' checks; returns the layout they describe."""
    try:
        dims = ParallelDims(ranks, shape.num_experts, ownership, even=False)
        dims.check_floor(floor)
    except LayoutError as e:
        raise PlanError(str(e)) from None
    if layout not in LAYOUTS:
        raise PlanError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if not 0 < alpha < 1:
        raise PlanError(f"alpha must be in (0, 1), got {alpha}")
    if objective not in OBJECTIVES:
        raise PlanError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if not batch:
        raise PlanError("the batch is empty")
    keys = [(b.prompt_id, b.sample) for b in batch]
    if len(set(keys)) != len(keys):
        raise PlanError("the batch holds a (prompt_id, sample) twice")
    return dims


def _tiers(sizes: list[int]) -> list[list[int]]:
    """Ranks grouped by the stage they leave at, residents (the last stage's members) first."""
    tiers = [list(range(sizes[-1]))]
    for i in range(len(sizes) - 1, 0, -1):
        tiers.append(list(range(sizes[i], sizes[i - 1])))
    return tiers


def _samples(dists: Sequence[LengthDist], exact: bool, seed: int) -> np.ndarray:
    """(samples, responses) lengths drawn from the predictive distributions."""
    mu = np.array([d.mu for d in dists])
    if exact:
        return np.expm1(mu)[None, :]
    sd = np.array([d.sd for d in dists])
    cap = np.array([d.cap or math.inf for d in dists])
    count = int(np.clip(2**15 // max(len(dists), 1), *SAMPLES))
    z = np.random.default_rng(seed).standard_normal((count, len(dists)))
    return np.minimum(np.maximum(np.expm1(mu + sd * z), 1.0), cap)
