"""`make_plan`: the one entry point the runtime and the simulator call.

Order of decisions (each step documented in its own module):
1. predict every response's length from the history (`predict.Predictor`, epochs before the batch
   only) or take the true lengths (`true_lengths`, the `oracle` policy);
2. size each response's KV by a length distribution (`kv.Demand`): TailGuard's calibrated one
   (`guard.TailGuard`) with `PlanChoices.tailguard`, the predictor's own without it, the true length for
   the oracle; its reserved length (the bound, or the (1 - alpha) quantile) orders placement;
3. price the floor against the device's memory budget (`shape.MemoryBudget`: weights, experts
   held, resident state, KV): reject a floor that cannot hold every expert, and raise one whose
   ranks would have no room left for the largest response's KV cache (`_memory_floor`);
4. for every quorum chain from W down to at least the floor (`schedule.chains`), build its stages,
   the per-rank KV budgets at the tightest stage each rank belongs to, and the layout under those
   budgets (`natural` and `lengthsort` place once and only check); drop chains whose layout cannot
   fit; price the rest over samples of the predictive distribution (`chains.estimate.ChainTimeline`)
   and keep the one with the fewest occupied rank-seconds (the largest release area net of lengthening;
   `PlanChoices.objective` "rollout" keeps the shortest predicted rollout instead);
5. with a `blocks` layout (`Platform.dims.ownership`, the megatron backend) every stage is megatron-core's contiguous
   blocks, so only group sizes that divide the expert count are candidates (`schedule` module doc);
6. with a weak predictor (the prompt explains under `WEAK_ICC` of the length variance), `planned`
   places like `lengthsort`: residency built on noise would only concentrate random long responses.

`floor == ranks` gives the single-stage plan (nobody leaves): `vanilla` is `natural` with it,
`lengthsort` the same with `layout="lengthsort"`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np

from elastic.planning.chains.search import BatchBeliefs, ChainSearch, objective_key
from elastic.planning.choices import PlanChoices
from elastic.planning.dims import LayoutError
from elastic.planning.layout import layout_kind
from elastic.planning.lengths.guard import TailGuard, reserves
from elastic.planning.lengths.predict import LengthDist, Predictor
from elastic.planning.lengths.remaining import conditioned
from elastic.planning.memory.kv import Demand
from elastic.planning.memory.kv_unit import share_groups
from elastic.planning.plan import Assignment, Plan, PlanError
from elastic.planning.platform import Platform
from elastic.planning.shape import MemoryBudget
from elastic.planning.step_cost import FixedCost, ShapeCost, StepCost
from elastic.trace import Trace

__all__ = ["FixedCost", "PlanError", "ShapeCost", "StepCost", "make_plan", "plan_epoch"]

WEAK_ICC = 0.1
# Length samples the release estimate averages over: 32 for a 1,024-response batch, fewer for
# larger batches, whose many ranks average out on their own.
SAMPLES = (8, 32)


class BatchItem(Protocol):
    prompt_id: str
    sample: int
    prompt_len: int


def make_plan(batch: Sequence[BatchItem], history: Trace, *, platform: Platform, layout: str,
              choices: PlanChoices, true_lengths: dict[tuple[str, int], int] | None = None,
              max_response_len: int | None = None,
              known_prefix: dict[tuple[str, int], int] | None = None) -> Plan:
    """Plan one rollout of `batch` (data order) under `layout` on `platform` (its ranks and the
    expert ownership their backend carries out, the model's shape, the device memory every check
    prices weights, experts and KV against, and the step cost) with the run's `choices` (the floor,
    TailGuard, the objective); see the module docstring.

    Only `prompt_id`, `sample` and `prompt_len` of the batch are read. `true_lengths`: every
    response's length, known (the `oracle` policy). `max_response_len` is the generation cap; it is
    inferred from truncated history records when omitted, and is required when the history is empty
    (nothing else bounds a response's KV then). `known_prefix`: the tokens so far of responses
    carried over from an earlier rollout (partial rollouts); their `prompt_len` counts those tokens
    (they are re-prefilled), and they are planned by what is left of them
    (`lengths.remaining.conditioned`: the length given it exceeds the tokens so far).
    """
    _validate(batch, platform, layout, choices)
    dims, shape, budget, alpha = platform.dims, platform.shape, platform.budget, choices.alpha
    ranks = dims.world
    keys = [(b.prompt_id, b.sample) for b in batch]
    prompt_len = np.array([b.prompt_len for b in batch], float)
    E = shape.num_experts

    lengths = (_true_lengths(keys, true_lengths) if true_lengths is not None else
               _predicted_lengths(batch, keys, history, choices.tailguard, alpha, max_response_len, known_prefix))
    meta, reserve, weak = lengths.meta, lengths.reserve, lengths.weak

    # The longest response's bound, in tokens: the runtime turns it into the predicted restoration
    # time that caps every lease.
    meta["predicted_max_len"] = float(reserve.max()) if len(reserve) else 0.0
    demand = Demand(lengths.kv_dists, prompt_len, alpha, lengths.tail_floor, budget.kv,
                    share_groups(keys, known_prefix))
    floor = _memory_floor(choices.floor, ranks, E, budget, demand, shape.name, meta)

    effective = layout_kind(layout).placed_as(weak)
    if effective != layout:
        meta["fallback"] = (f"{layout} placed as {effective}: the prompt explains "
                            f"{meta['predictor']['icc']:.1%} of length variance (< {WEAK_ICC:.0%})")
    beliefs = BatchBeliefs(keys, lengths.work, reserve, demand,
                           _samples(lengths.dists, true_lengths is not None, choices.seed), float(prompt_len.mean()))
    search_at = partial(ChainSearch, beliefs, platform, layout=effective, objective=choices.objective)
    search, (est, sizes, stages, rank_of) = _best_chain(search_at, floor, ranks, E, budget, demand, meta)
    meta.update({
        "chain": sizes, "chains_feasible": search.feasible, "chains_priced": len(search.cache),
        "effective_layout": effective, "predicted_rollout_s": est.rollout_s,
        "predicted_static_rollout_s": est.static_s, "predicted_occupied_rank_s": est.occupied_rank_s,
        "leave_order": search.leave_order,
    })
    plan = Plan(ranks=ranks, floor=floor, num_experts=E, layout=layout, tailguard=choices.tailguard,
                assignments=[Assignment(pid, s, r) for (pid, s), r in zip(keys, rank_of)],
                stages=stages, predicted_release_rank_s=est.detached_rank_s, meta=meta, ownership=dims.ownership)
    plan.check(keys)
    return plan


@dataclass
class _Lengths:
    """What the planner believes about each response's length (batch order): the distributions it
    prices chains on (`dists`) and sizes KV by (`kv_dists`: TailGuard's when on), the work it places
    by (`work`, the medians) and the tokens it reserves (`reserve`)."""
    dists: list[LengthDist]
    kv_dists: list[LengthDist]
    work: np.ndarray
    reserve: np.ndarray
    tail_floor: float
    weak: bool  # the predictor explains too little of the length variance to place by (`WEAK_ICC`)
    meta: dict


def _true_lengths(keys, true_lengths: dict[tuple[str, int], int]) -> _Lengths:
    """The `oracle` policy's beliefs: every length is known exactly."""
    missing = [k for k in keys if k not in true_lengths]
    if missing:
        raise PlanError(f"true_lengths lacks {len(missing)} responses of the batch, e.g. {missing[0]}")
    truth = np.array([true_lengths[k] for k in keys], float)
    dists = [LengthDist(math.log1p(x), 0.0, None, True) for x in truth]
    return _Lengths(dists, dists, truth, truth, 0.0, False, {"predictor": "oracle"})


def _predicted_lengths(batch, keys, history: Trace, tailguard: bool, alpha: float,
                       max_response_len: int | None, known_prefix: dict | None) -> _Lengths:
    """The lengths predicted from the history, their KV reserved by TailGuard's bound (`tailguard`)
    or the predictor's (1 - alpha) quantile, conditioned on the tokens carried over (`known_prefix`)."""
    pred = Predictor(history, cap=max_response_len)
    if pred.empty and pred.cap is None:
        raise PlanError("no length history and no max_response_len: nothing bounds a "
                        "response's KV cache "
                        "(pass the generation cap: max_response_len, `flexfloor plan --max-response-len`)")
    dists = pred.predict_batch(batch)
    work = np.array([d.median for d in dists])
    guard = TailGuard.fit(history, alpha, cap=pred.cap) if tailguard else None
    reserve = np.array(reserves(dists, guard, alpha))
    if guard is not None:
        kv_dists, tail_floor = [guard.guarded(d) for d in dists], guard.tail_floor
    else:
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
    return _Lengths(dists, kv_dists, work, reserve, tail_floor, weak, meta)


def _best_chain(search_at, floor: int, ranks: int, E: int, budget: MemoryBudget, demand: Demand, meta: dict):
    """(the search, its best chain) down to `floor`. Where not even all ranks hold the batch at
    once, a cache that queues (`KVUnit.queues`: the engine admits what fits, the rest waits) is
    planned anyway: every rank stays (a shrink would only lengthen the queues), the layout is placed
    with no KV check, and `meta["kv_queued"]` says why; the run is slower than planned, not refused.
    A response that no rank holds even alone would wait for ever, and is refused."""
    try:
        search = search_at(floor=floor)
        return search, search.best()
    except PlanError as e:
        alone = float(demand.own_peaks().max()) * budget.kv_bytes_per_token
        if not budget.kv.queues or alone > budget.kv_budget_bytes(math.ceil(E / ranks)):
            raise
        meta["kv_queued"] = (f"the batch does not fit the {budget.kv.kind} KV cache at once, even on all "
                             f"{ranks} ranks ({e}); every rank stays and the ranks queue what does not fit")
    search = search_at(floor=ranks, queued=True)
    return search, search.best()


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


def plan_epoch(trace: Trace, epoch: int, *, platform: Platform, layout: str, choices: PlanChoices,
               oracle: bool = False, max_response_len: int | None = None) -> Plan:
    """Plan epoch `epoch` of a trace from the epochs before it (the history a live run would have);
    `oracle`: on its true lengths."""
    batch = trace.epoch(epoch)
    true_lengths = {r.key: r.response_len for r in batch} if oracle else None
    return make_plan(batch, trace.before(epoch), platform=platform, layout=layout, choices=choices,
                     true_lengths=true_lengths, max_response_len=max_response_len)


def _validate(batch, platform: Platform, layout: str, choices: PlanChoices) -> None:
    """The inputs' checks (the layout checked itself when it was built)."""
    dims, shape = platform.dims, platform.shape
    if dims.experts != shape.num_experts:
        raise PlanError(f"dims: expected the {shape.num_experts} experts of {shape.name}, got {dims.experts}")
    try:
        dims.check_floor(choices.floor)
    except LayoutError as e:
        raise PlanError(str(e)) from None
    layout_kind(layout)  # a PlanError naming the layouts
    if not 0 < choices.alpha < 1:
        raise PlanError(f"alpha: expected in (0, 1), got {choices.alpha}")
    objective_key(choices.objective)  # a PlanError naming the objectives
    if not batch:
        raise PlanError("the batch is empty")
    keys = [(b.prompt_id, b.sample) for b in batch]
    if len(set(keys)) != len(keys):
        raise PlanError("the batch holds a (prompt_id, sample) twice")


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
