"""Fit a cost model's constants to measured step, shrink and restore times (the cost model itself
is `elastic/sim/costmodel.py`; fitting it to whole rollout ledgers, `elastic/sim/calibrate.py`)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from elastic.planning.busiest import busiest_load
from elastic.sim.costmodel import DEFAULT_COST, CostModel

# Fitted fields, in feature order: each is a feature's coefficient or its inverse (a rate); on a
# CPU host the in-node all-to-all features are one latency per EP size instead (`a2a_host_latency_s`).
_FITTED = ("step_overhead_s", "hbm_bytes_per_s", "flops_per_s", "a2a_intra_latency_s", "a2a_intra_per_peer_s")
_RATES = ("hbm_bytes_per_s", "flops_per_s")


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares `x @ coef ~ y` with every coefficient >= 0: a column whose coefficient comes
    out negative is dropped (coefficient 0) and the rest refitted. All-zero columns stay 0."""
    coef = np.zeros(x.shape[1])
    active = [j for j in range(x.shape[1]) if np.abs(x[:, j]).max() > 0]
    scale = np.abs(x).max(axis=0)
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol / scale[active]
            break
        active = [j for j, c in zip(active, sol) if c >= 0]
    return coef


def _sample(s: Sequence[float]) -> tuple[float, float, int, float, int]:
    """`(batch_per_rank, context, ep_size, seconds[, busy])`, busy defaulting to every member."""
    b, c, g, secs, *rest = s
    return float(b), float(c), int(g), float(secs), int(rest[0]) if rest else int(g)


def _features(base: CostModel, batch: float, context: float, ep_size: int, busy: int,
              host_sizes: Sequence[int] = ()) -> list[float]:
    """A step's time is linear in these, with coefficients [overhead, 1/hbm, 1/flops] and then
    [in-node all-to-all latency per layer, and per extra peer], or with `host_sizes` one latency
    per layer for each of those EP sizes; plus `_unfitted_s`."""
    s = base.shape
    g, n = float(ep_size), float(batch)
    kv, own, big_n = n * context, s.num_experts / g, n * busy
    hit = 1.0 - (1.0 - s.topk / s.num_experts) ** big_n
    mem = (n > 0) * s.step_dense_bytes + kv * s.kv_bytes_per_token \
        + own * hit * s.expert_params_per_layer * s.num_layers * s.bytes_per_param
    flops = 2.0 * n * s.step_dense_params + kv * s.attn_flops_per_kv_token \
        + 2.0 * big_n * s.topk * own / s.num_experts * s.expert_params_per_layer * s.num_layers
    intra_layers = float(s.num_layers) if 1 < g <= s.ranks_per_node else 0.0
    c = float(base.contention(busy))
    if host_sizes:
        return [c, c * mem, c * flops] + [intra_layers * (g == h) for h in host_sizes]
    return [c, c * mem, c * flops, intra_layers, intra_layers * max(g - 2.0, 0.0)]


def _unfitted_s(base: CostModel, batch: float, ep_size: int) -> float:
    """The all-to-all terms `calibrate` keeps at `base`: traffic, and the inter-node latency."""
    in_node = 1 < ep_size <= base.shape.ranks_per_node
    intra = float(base.shape.num_layers * base.intra_latency_s(ep_size)) if in_node else 0.0
    return float(base.a2a_s(ep_size, batch)) - intra


def _fit_steps(samples: list[tuple[float, float, int, float, int]], base: CostModel) -> CostModel:
    host_sizes = sorted({g for _b, _c, g, _s, _k in samples if 1 < g <= base.shape.ranks_per_node}) \
        if base.host_cores else []
    x = np.array([_features(base, b, c, g, k, host_sizes) for b, c, g, _, k in samples], dtype=np.float64)
    y = np.array([s - _unfitted_s(base, b, g) for b, _c, g, s, _k in samples], dtype=np.float64)
    # Relative errors: a short step's miss counts as much as a long one's.
    w = 1.0 / np.array([s for _b, _c, _g, s, _k in samples], dtype=np.float64)
    coef = nonneg_lstsq(x * w[:, None], y * w)
    fitted = {}
    for j, name in enumerate(_FITTED[:3] if host_sizes else _FITTED):
        if x[:, j].max() <= 0:  # a feature the samples do not exercise keeps base's value
            continue
        if name in _RATES:
            # A zero coefficient means the term does not show in the samples: a huge rate, not inf.
            fitted[name] = 1.0 / float(coef[j]) if coef[j] > 0 else 1e30
        else:
            fitted[name] = float(coef[j])
    if host_sizes:
        fitted["a2a_host_latency_s"] = tuple((g, float(c)) for g, c in zip(host_sizes, coef[3:]))
    return replace(base, name=f"{base.name}+calibrated", **fitted)


def calibrate(samples: Sequence[Sequence[float]], base: CostModel = DEFAULT_COST) -> CostModel:
    """Fit the step-time constants to measured `(batch_per_rank, mean_context, ep_size, seconds)`
    samples, optionally with a fifth element: the members holding requests (the rest run dummy
    steps; default all).

    The shape fields (layers, experts, bytes per parameter and per KV token) stay those of `base`, so
    pass a `base` that describes the measured model (e.g. the tiny CPU model with `ranks_per_node`
    set to the ranks of the machine). Least squares on relative errors with every coefficient kept
    non-negative (`nonneg_lstsq`). A feature absent from the samples (e.g. no multi-rank group)
    keeps its `base` value; one fitted to zero becomes negligible.

    With `base.host_cores` > 0 (ranks sharing a CPU host) the in-node all-to-all is fitted as one
    latency per sampled EP size (`a2a_host_latency_s`), and, given samples with fewer busy members
    than others, the effective cores too: the count in 0.5..host_cores (steps of 1/8) whose fit has
    the least mean relative error, since other load on the host leaves the ranks fewer cores than
    it has.
    """
    if len(samples) < 2:
        raise ValueError(f"calibrate needs at least 2 step-time samples, got {len(samples)}")
    pts = [_sample(s) for s in samples]
    if not base.host_cores or len({k for *_, k in pts}) < 2:
        return _fit_steps(pts, base)
    fits = [_fit_steps(pts, replace(base, host_cores=float(n)))
            for n in np.arange(0.5, base.host_cores + 1e-9, 0.125)]
    return min(fits, key=lambda m: fit_error(m, pts))


def fit_error(model: CostModel, samples: Sequence[Sequence[float]]) -> float:
    """Mean relative error of `model.decode_step_s` on the samples (how good a calibration is)."""
    errs = [abs(model.decode_step_s(b, c, g, k) - s) / s for b, c, g, s, k in map(_sample, samples) if s > 0]
    return float(np.mean(errs)) if errs else 0.0


def calibrate_transitions(shrinks: Sequence[tuple[Sequence[tuple[int, int, int]], float]],
                          restores: Sequence[tuple[Sequence[tuple[int, int, int]], float]],
                          base: CostModel) -> CostModel:
    """Fit `shrink_fixed_s`, the in-node transfer rate and `restore_extra_s` to measured shrinks
    and restores, each `(moves, seconds)` with `moves` as `Plan.transfers` gives them, all inside one
    node. A shrink costs the fixed cost plus the busiest rank's bytes over the rate (`transfer_s`);
    the rate keeps `base`'s value unless the shrinks move different loads. A restore costs that
    plus `restore_extra_s`, the mean excess of the measured restores."""
    def busiest_bytes(moves) -> float:
        for _e, src, dst in moves:
            if src // base.shape.ranks_per_node != dst // base.shape.ranks_per_node:
                raise ValueError(f"calibrate_transitions: move {src} -> {dst} leaves the node")
        return busiest_load((src, dst, 1.0) for _e, src, dst in moves) * float(base.shape.expert_bytes)

    fitted = base
    moving = [(busiest_bytes(m), s) for m, s in shrinks if m]
    if moving:
        x = np.array([[1.0, b] for b, _ in moving])
        y = np.array([s for _, s in moving])
        if np.ptp(x[:, 1]) == 0:  # one load only: the rate cannot be told from the fixed cost
            y = y - x[:, 1] / base.transfer_intra_bytes_per_s
            x[:, 1] = 0.0
        fixed, per_byte = nonneg_lstsq(x, y)
        fitted = replace(fitted, shrink_fixed_s=max(float(fixed), 1e-9),
                         **({"transfer_intra_bytes_per_s": 1.0 / per_byte} if per_byte > 0 else {}))
    if restores:
        excess = [s - max(fitted.transfer_s(m), fitted.shrink_fixed_s) for m, s in restores]
        fitted = replace(fitted, restore_extra_s=max(0.0, float(np.mean(excess))))
    return fitted
