"""Fit a cost model to measured rollout ledgers (the real engine's rank-seconds per state).

`costmodel.calibrate` fits step constants to probed step times. A shared or noisy machine makes
probes taken at another moment unreliable, so this second stage fits three scale factors, one per
part of a decode step, to whole rollouts measured beside the ones to be predicted:

    tick = contention * (p_overhead * overhead + p_compute * max over members(compute)) + p_a2a * a2a

Every tick's ledger state depends only on step counts, so each state's rank-seconds is linear in
(p_overhead, p_compute, p_a2a): simulating the plan once per part gives the basis, and a
non-negative least-squares fit over every calibration run's states gives the factors.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from elastic.costmodel import CostModel
from elastic.ledger import STATES
from elastic.plan import Plan
from elastic.simulate import SimConfig, simulate_rollout
from elastic.trace import TraceRecord

_OFF_RATE = 1e30  # a rate that makes its term vanish (rates must stay > 0)
PARTS = ("overhead", "compute", "a2a")


def _only(cost: CostModel, part: str | None) -> CostModel:
    """`cost` with every step term but `part` switched off (None: only shrinks and restores)."""
    off = {}
    if part != "overhead":
        off["step_overhead_s"] = 0.0
    if part != "compute":
        off.update(hbm_bytes_per_s=_OFF_RATE, flops_per_s=_OFF_RATE)
    if part != "a2a":
        off.update(a2a_intra_latency_s=1e-30, a2a_intra_per_peer_s=0.0, a2a_intra_bytes_per_s=_OFF_RATE,
                   a2a_inter_bytes_per_s=_OFF_RATE,
                   a2a_inter_latency_s=tuple((e, 0.0) for e, _ in cost.a2a_inter_latency_s))
    if part is not None:
        # Shrinks and restores belong to the fixed remainder, counted once.
        off.update(shrink_fixed_s=1e-30, transfer_intra_bytes_per_s=_OFF_RATE, transfer_inter_bytes_per_s=_OFF_RATE)
    return replace(cost, **off)


def basis(plan: Plan, batch: Sequence[TraceRecord], cost: CostModel, config: SimConfig) -> np.ndarray:
    """(len(STATES), 4) rank-seconds per state of each part alone (overhead, compute, all-to-all)
    and of the shrinks/restores (the fixed remainder, last column)."""
    if config.lease:
        raise ValueError("fit_to_ledgers needs lease=False: a lease's start time is not linear in the factors")
    cols = []
    for part in (*PARTS, None):
        secs = simulate_rollout(plan, batch, _only(cost, part), config=config).ledger.rank_seconds()
        cols.append([secs[s] for s in STATES])
    return np.array(cols).T


def fit_to_ledgers(runs: Sequence[tuple[Plan, Sequence[TraceRecord], dict]], cost: CostModel,
                   config: SimConfig) -> tuple[CostModel, dict]:
    """Scale `cost`'s overhead, compute and all-to-all terms so that simulating each run's plan
    reproduces its measured `rank_seconds` (a dict per state) in the least-squares sense.
    Returns the fitted model and the factors."""
    rows, target = [], []
    for plan, batch, measured in runs:
        b = basis(plan, batch, cost, config)
        for i, s in enumerate(STATES):
            if measured.get(s, 0.0) > 0 or b[i, :3].any():
                rows.append(b[i, :3])
                target.append(measured.get(s, 0.0) - b[i, 3])
    x, y = np.array(rows), np.array(target)
    active = [j for j in range(3) if x[:, j].any()]
    coef = np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [j for j, c in zip(active, sol) if c >= 0]
    factors = dict(zip(PARTS, map(float, coef)))
    o, c, a = coef
    fitted = replace(
        cost, name=f"{cost.name}+ledger-fit",
        step_overhead_s=cost.step_overhead_s * o,
        hbm_bytes_per_s=cost.hbm_bytes_per_s / c if c > 0 else _OFF_RATE,
        flops_per_s=cost.flops_per_s / c if c > 0 else _OFF_RATE,
        a2a_intra_latency_s=max(cost.a2a_intra_latency_s * a, 1e-30),
        a2a_intra_per_peer_s=cost.a2a_intra_per_peer_s * a,
        a2a_intra_bytes_per_s=cost.a2a_intra_bytes_per_s / a if a > 0 else _OFF_RATE,
        a2a_inter_bytes_per_s=cost.a2a_inter_bytes_per_s / a if a > 0 else _OFF_RATE,
        a2a_inter_latency_s=tuple((e, s * a) for e, s in cost.a2a_inter_latency_s),
    )
    return fitted, factors
