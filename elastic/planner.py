"""`make_plan`: the one entry point the runtime and the simulator call.

Order of decisions (each step documented in its own module):
1. predict every response's length from the history (`predict.Predictor`, epochs before the batch
   only) or take the true lengths (`true_lengths`, the `oracle` policy);
2. size each response's KV by a length distribution (`kv.Demand`): TailGuard's calibrated one
   (`guard.TailGuard`) with `tailguard=True`, the predictor's own without it, the true length for
   the oracle; its reserved length (the bound, or the (1 - alpha) quantile) orders placement;
3. reject a floor that cannot hold every expert;
4. for every quorum chain from W down to at least the floor (`schedule.chains`), build its stages,
   the per-rank KV budgets at the tightest stage each rank belongs to, and the layout under those
   budgets (`natural` and `lengthsort` place once and only check); drop chains whose layout cannot
   fit; price the rest over samples of the predictive distribution (`release.Timeline`) and keep
   the one with the fewest occupied rank-seconds (the largest release area net of lengthening);
5. with a weak predictor (the prompt explains under `WEAK_ICC` of the length variance), `planned`
   places like `lengthsort`: residency built on noise would only concentrate random long responses.

`floor == ranks` gives the single-stage plan (nobody leaves): `vanilla` is `natural` with it,
`lengthsort` the same with `layout="lengthsort"`.
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence

import numpy as np

from elastic import layout as layouts
from elastic.guard import TailGuard
from elastic.kv import Demand, RankKV
from elastic.plan import Plan, PlanError
from elastic.predict import LengthDist, Predictor
from elastic.release import ShapeCost, StepCost, Timeline, rank_drain_steps
from elastic.schedule import build_stages, chains, held_counts
from elastic.shape import ModelShape
from elastic.trace import Trace

__all__ = ["make_plan", "plan_epoch", "PlanError", "StepCost", "ShapeCost", "LAYOUTS"]

LAYOUTS = ("natural", "lengthsort", "planned")
WEAK_ICC = 0.1
SAMPLES = 64


class BatchItem(Protocol):
    prompt_id: str
    sample: int
    prompt_len: int


def make_plan(batch: Sequence[BatchItem], history: Trace, *, ranks: int, floor: int,
              shape: ModelShape, layout: str, tailguard: bool, alpha: float = 0.05,
              cost: StepCost | None = None,
              true_lengths: dict[tuple[str, int], int] | None = None,
              max_response_len: int | None = None, seed: int = 0) -> Plan:
    """Plan one rollout of `batch` (data order) on `ranks` ranks; see the module docstring.

    Only `prompt_id`, `sample` and `prompt_len` of the batch are read. `max_response_len` is the
    generation cap; it is inferred from truncated history records when omitted, and is required
    when the history is empty (nothing else bounds a response's KV then).
    """
    _validate(batch, ranks, floor, shape, layout, alpha)
    cost = cost or ShapeCost(shape)
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
                            "(pass the generation cap, --max-response-len)")
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
        weak = pred.empty or pred.icc < WEAK_ICC
        meta = {"predictor": {"icc": round(pred.icc, 4), "weak": weak, "cap": pred.cap,
                              "history_records": len(history)}}
        if guard is not None:
            meta["tailguard"] = {"alpha": alpha, "margin": guard.margin,
                                 "calibrated_on": guard.calibrated_on}

    held_floor = math.ceil(E / floor)
    if shape.kv_budget_bytes(held_floor) <= 0:
        raise PlanError(
            f"floor {floor} cannot hold the {E} experts of {shape.name}: {held_floor} experts per "
            f"rank take {held_floor * shape.expert_bytes / 1e9:.2f} GB beside "
            f"{shape.dense_bytes / 1e9:.2f} GB of dense weights, over the "
            f"{shape.usable_bytes / 1e9:.2f} GB usable per rank")

    demand = Demand(kv_dists, prompt_len, alpha, tail_floor)
    samples = _samples(dists, true_lengths is not None, seed)
    effective = "lengthsort" if layout == "planned" and weak else layout
    if effective != layout:
        meta["fallback"] = (f"planned placed as lengthsort: the prompt explains "
                            f"{meta['predictor']['icc']:.1%} of length variance (< {WEAK_ICC:.0%})")
    all_chains = list(chains(ranks, floor, E)) if floor < ranks else [[ranks]]
    sizes_grid = sorted({g for c in all_chains for g in c[1:]}, reverse=True)
    pmean = float(prompt_len.mean())

    def timeline(assignment, order):
        rank_of = np.array([a.rank for a in assignment])
        return Timeline(samples, rank_of, order, sizes_grid, pmean, cost)

    if effective == "planned":
        order, fixed, tl = list(range(ranks)), None, None
    else:
        # The baselines place once, under the full world's budgets; the chain only decides who
        # stays, in the order the ranks are predicted to drain (latest stays longest).
        kv = RankKV(demand, _budgets(build_stages([ranks], E), ranks, shape))
        try:
            fixed = (layouts.natural(keys, ranks) if effective == "natural" else
                     layouts.lengthsort(keys, work, ranks, reserve, kv))
            if effective == "natural":
                layouts.check_kv(fixed, kv)
        except PlanError as e:
            raise PlanError(f"{ranks} ranks cannot hold the batch: {e}") from None
        drain = rank_drain_steps(samples, np.array([a.rank for a in fixed]), ranks).mean(axis=0)
        order = sorted(range(ranks), key=lambda r: (-drain[r], r))
        tl = timeline(fixed, order)

    best, considered, reasons = None, 0, []
    for sizes in all_chains:
        stages = build_stages(sizes, E, order)
        kv = RankKV(demand, _budgets(stages, ranks, shape))
        try:
            if fixed is not None:
                assignment = fixed
                layouts.check_kv(assignment, kv)
            else:
                assignment = layouts.planned(keys, work, _tiers(sizes), reserve, kv)
        except PlanError as e:
            reasons.append(f"chain {sizes}: {e}")
            continue
        considered += 1
        chain = Plan(ranks, floor, E, layout, tailguard, [], stages)
        shrink = [0.0] + [cost.shrink_s(len(chain.transfers(i - 1, i)), sizes[i - 1])
                          for i in range(1, len(sizes))]
        est = (tl or timeline(assignment, order)).estimate(sizes, shrink)
        if best is None or (est.occupied_rank_s, -est.detached_rank_s) < \
                (best[0].occupied_rank_s - 1e-9, -best[0].detached_rank_s):
            best = (est, sizes, stages, assignment)
    if best is None:
        raise PlanError(f"no quorum schedule from {ranks} ranks down to floor {floor} fits the KV "
                        f"cache; {reasons[0]}")
    est, sizes, stages, assignment = best
    meta.update({
        "chain": sizes, "chains_feasible": considered, "effective_layout": effective,
        "predicted_rollout_s": est.rollout_s, "predicted_static_rollout_s": est.static_s,
        "predicted_occupied_rank_s": est.occupied_rank_s,
    })
    plan = Plan(ranks=ranks, floor=floor, num_experts=E, layout=layout, tailguard=tailguard,
                assignments=assignment, stages=stages,
                predicted_release_rank_s=est.detached_rank_s, meta=meta)
    plan.check(keys)
    return plan


def plan_epoch(trace: Trace, epoch: int, **kw) -> Plan:
    """Plan epoch `epoch` of a trace from the epochs before it (the history a live run would have)."""
    batch = trace.epoch(epoch)
    if kw.pop("oracle", False):
        kw["true_lengths"] = {r.key: r.response_len for r in batch}
    return make_plan(batch, trace.before(epoch), **kw)


def _validate(batch, ranks, floor, shape, layout, alpha):
    if not 1 <= ranks:
        raise PlanError(f"ranks must be >= 1, got {ranks}")
    if not 1 <= floor <= ranks:
        raise PlanError(f"floor must be in 1..ranks ({ranks}), got {floor}")
    if layout not in LAYOUTS:
        raise PlanError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if not 0 < alpha < 1:
        raise PlanError(f"alpha must be in (0, 1), got {alpha}")
    if not batch:
        raise PlanError("the batch is empty")
    keys = [(b.prompt_id, b.sample) for b in batch]
    if len(set(keys)) != len(keys):
        raise PlanError("the batch holds a (prompt_id, sample) twice")


def _budgets(stages, ranks: int, shape: ModelShape) -> list[float]:
    """KV tokens each rank may hold: the least over the stages it is a member of."""
    budget = [math.inf] * ranks
    for st in stages:
        for r, h in held_counts(st.owners, st.members).items():
            budget[r] = min(budget[r], shape.kv_budget_bytes(h) // shape.kv_bytes_per_token)
    return budget


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
    z = np.random.default_rng(seed).standard_normal((SAMPLES, len(dists)))
    return np.minimum(np.maximum(np.expm1(mu + sd * z), 1.0), cap)
