"""Fit a cost model to measured rollout ledgers (the real engine's rank-seconds per state).

`step_fit.calibrate` fits step constants to probed step times. A shared or noisy machine makes
probes taken at another moment unreliable, so this second stage scales the parts of a decode step
to whole rollouts measured beside the ones to be predicted:

    tick = contention * (p_overhead * overhead + p_compute * max over members(compute)) + p_a2a * a2a

Every tick's ledger state depends only on step counts, so each state's rank-seconds is linear in
the factors: simulating the plan once per group of parts gives the basis, and a non-negative
least-squares fit over every calibration run's states gives the factors.

Which factors the runs can identify depends on them. `PER_PART` (one factor each) needs runs that
vary the group size; runs of one group size (static policies of W ranks) cannot tell the per-step
overhead from the all-to-all, both paid once a tick, and a per-part fit to them extrapolates to other
group sizes by chance. `WHOLE_STEP` (one factor for the whole step) keeps the probed shape of
the costs and corrects only the machine's speed, which any runs identify.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from elastic.ledger import STATES
from elastic.planning.plan import Plan
from elastic.sim.costmodel import CostModel
from elastic.sim.simulate import SimConfig, simulate_rollout
from elastic.sim.step_fit import nonneg_lstsq
from elastic.trace import TraceRecord

_OFF_RATE = 1e30  # a rate that makes its term vanish (rates must stay > 0)
PARTS = ("overhead", "compute", "a2a")
PER_PART = tuple((p,) for p in PARTS)
WHOLE_STEP = (PARTS,)


def _scale_part(cost: CostModel, part: str, factor: float) -> dict:
    """The fields of `part` with its durations times `factor` (rates divided by it); factor 0
    switches the part off."""
    def rate(v: float) -> float:
        return v / factor if factor > 0 else _OFF_RATE

    if part == "overhead":
        return {"step_overhead_s": cost.step_overhead_s * factor}
    if part == "compute":
        return {"hbm_bytes_per_s": rate(cost.hbm_bytes_per_s), "flops_per_s": rate(cost.flops_per_s)}
    return {"a2a_intra_latency_s": max(cost.a2a_intra_latency_s * factor, 1e-30),
            "a2a_intra_per_peer_s": cost.a2a_intra_per_peer_s * factor,
            "a2a_intra_bytes_per_s": rate(cost.a2a_intra_bytes_per_s),
            "a2a_inter_bytes_per_s": rate(cost.a2a_inter_bytes_per_s),
            "a2a_inter_latency_s": tuple((e, s * factor) for e, s in cost.a2a_inter_latency_s),
            "a2a_host_latency_s": tuple((e, s * factor) for e, s in cost.a2a_host_latency_s)}


def _only(cost: CostModel, parts: Sequence[str] | None) -> CostModel:
    """`cost` with every step part outside `parts` switched off (None: only shrinks and restores)."""
    off = {}
    for part in PARTS:
        if parts is None or part not in parts:
            off.update(_scale_part(cost, part, 0.0))
    if parts is not None:
        # Shrinks and restores belong to the fixed remainder, counted once.
        off.update(shrink_fixed_s=1e-30, restore_extra_s=0.0, transfer_intra_bytes_per_s=_OFF_RATE,
                   transfer_inter_bytes_per_s=_OFF_RATE)
    return replace(cost, **off)


def basis(plan: Plan, batch: Sequence[TraceRecord], cost: CostModel, config: SimConfig,
          groups: Sequence[Sequence[str]] = PER_PART) -> np.ndarray:
    """(len(STATES), len(groups) + 1) rank-seconds per state of each group of parts alone and of
    the shrinks/restores (the fixed remainder, last column)."""
    if config.lease:
        raise ValueError("fit_to_ledgers needs lease=False: a lease's start time is not linear in the factors")
    cols = []
    for parts in (*groups, None):
        secs = simulate_rollout(plan, batch, _only(cost, parts), config=config).ledger.rank_seconds()
        cols.append([secs[s] for s in STATES])
    return np.array(cols).T


def fit_to_ledgers(runs: Sequence[tuple[Plan, Sequence[TraceRecord], dict]], cost: CostModel,
                   config: SimConfig, groups: Sequence[Sequence[str]] = PER_PART) -> tuple[CostModel, dict]:
    """Scale `cost`'s step parts, one factor per group of `groups` (`PER_PART` or `WHOLE_STEP`), so
    that simulating each run's plan reproduces its measured `rank_seconds` (a dict per state) in the
    least-squares sense. Returns the fitted model and the factors, keyed by the groups' parts
    joined with '+'."""
    bad = sorted({p for g in groups for p in g} - set(PARTS))
    if bad or len([p for g in groups for p in g]) != len({p for g in groups for p in g}):
        raise ValueError(f"groups: expected disjoint groups of {PARTS}, got {groups}")
    n = len(groups)
    rows, target = [], []
    for plan, batch, measured in runs:
        b = basis(plan, batch, cost, config, groups)
        for i, s in enumerate(STATES):
            if measured.get(s, 0.0) > 0 or b[i, :n].any():
                rows.append(b[i, :n])
                target.append(measured.get(s, 0.0) - b[i, n])
    coef = nonneg_lstsq(np.array(rows), np.array(target))
    fields = {}
    for parts, factor in zip(groups, coef):
        for part in parts:
            fields.update(_scale_part(cost, part, float(factor)))
    fitted = replace(cost, name=f"{cost.name}+ledger-fit", **fields)
    return fitted, {"+".join(parts): float(f) for parts, f in zip(groups, coef)}
