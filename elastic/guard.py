"""TailGuard: a calibrated upper bound on every response's length.

The bound is the predictor's distribution widened by a margin fitted, split-conformal style, on
the errors the same predictor made on the newest epoch of the history:

    score_i = (log(1 + L_i) - mu_i) / sd_i        on epoch c = the newest history epoch,
                                                  predicted from epochs < c only
    margin  = the ceil((n + 1)(1 - alpha))-th smallest score
    bound   = min(cap, expm1(mu + margin * sd))   for every response of the next batch

so that, as far as epoch c's errors are exchangeable with the next epoch's, at most a share alpha
of responses outlive their bound. `guarded` shifts each predictive distribution so that its
(1 - alpha) quantile is the bound: the calibrated distribution the KV-safe layouts size against. A truncated response's score is a lower bound, taken as +inf (it
may need the whole cap); when the margin is +inf the bound is the cap. With a single epoch of
history, the calibration predictions are the population's (each prompt as if unseen), which is what
the predictor knew about epoch c before seeing it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from elastic.predict import LengthDist, Predictor, norm_ppf, score
from elastic.trace import Trace, TraceRecord


@dataclass(frozen=True)
class TailGuard:
    margin: float  # in units of each response's predictive sd; may be +inf
    alpha: float
    calibrated_on: int | None  # the epoch whose errors fitted the margin
    cap: int | None

    def bound(self, dist: LengthDist) -> float:
        if math.isinf(self.margin):
            return float(dist.cap) if dist.cap else math.inf
        return self.guarded(dist).quantile(1 - self.alpha)

    def guarded(self, dist: LengthDist) -> LengthDist:
        """The predictive distribution shifted (in log space) so that its (1 - alpha) quantile is
        the bound: the calibrated distribution the KV model uses (`kv.Demand`)."""
        if math.isinf(self.margin) or dist.sd == 0:
            return dist
        shift = (self.margin - norm_ppf(1 - self.alpha)) * dist.sd
        return LengthDist(dist.mu + shift, dist.sd, dist.cap, dist.seen)

    @property
    def tail_floor(self) -> float:
        """Least chance any response runs to the cap: alpha when the calibration epoch had more
        than alpha of its responses cut at the cap (the margin is then unbounded)."""
        return self.alpha if math.isinf(self.margin) else 0.0

    @classmethod
    def fit(cls, history: Trace, alpha: float = 0.05, cap: int | None = None,
            decay: float = 0.7) -> "TailGuard":
        if not 0 < alpha < 1:
            raise ValueError(f"TailGuard alpha must be in (0, 1), got {alpha}")
        epochs = history.epochs
        if not epochs:
            return cls(math.inf, alpha, None, cap)
        c = epochs[-1]
        calib = history.epoch(c)
        cap = cap if cap is not None else Predictor(history).cap
        prev = history.before(c)
        pred = Predictor(prev if len(prev) else history, cap=cap, decay=decay)
        if len(prev):
            dists = pred.predict_batch(calib)
        else:
            unseen = LengthDist(pred.mu, math.sqrt(pred.sigma2 + pred.tau2), cap, False)
            dists = [unseen] * len(calib)
        scores = sorted(_score(d, r) for d, r in zip(dists, calib))
        k = math.ceil((len(scores) + 1) * (1 - alpha))
        margin = scores[k - 1] if k <= len(scores) else math.inf
        return cls(margin, alpha, c, cap)


def _score(d: LengthDist, r: TraceRecord) -> float:
    if r.truncated:
        return math.inf
    if d.sd == 0:
        return math.inf if math.log1p(r.response_len) > d.mu else -math.inf
    return (math.log1p(r.response_len) - d.mu) / d.sd


def miss_rate(bounds: Sequence[float], actual: Sequence[TraceRecord]) -> float:
    """Share of responses longer than their bound (a truncated one misses any bound below the cap)."""
    misses = sum(1 for b, r in zip(bounds, actual) if r.response_len > b)
    return misses / len(actual) if actual else 0.0


def report(trace: Trace, alpha: float = 0.05, decay: float = 0.7) -> list[dict]:
    """Predictor and TailGuard quality on every epoch that has history, each predicted from the
    epochs before it only (the `flexfloor predict` table)."""
    cap = Predictor(trace).cap
    rows = []
    for e in trace.epochs[1:]:
        history = trace.before(e)
        batch = trace.epoch(e)
        pred = Predictor(history, cap=cap, decay=decay)
        dists = pred.predict_batch(batch)
        guard = TailGuard.fit(history, alpha, cap=cap, decay=decay)
        bounds = [guard.bound(d) for d in dists]
        row = {"epoch": e, **score(dists, batch), "icc": pred.icc,
               "tailguard": {"alpha": alpha, "margin": guard.margin,
                             "miss_rate": miss_rate(bounds, batch),
                             "mean_bound": float(np.mean(bounds))}}
        rows.append(row)
    return rows
