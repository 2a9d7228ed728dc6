"""TailGuard: a calibrated upper bound on every response's length.

The bound is the predictor's distribution widened by a margin fitted, split-conformal style, on
the errors the same predictor made on the newest epochs of the history:

    score_i = (log(1 + L_i) - mu_i) / sd_i        on the newest two history epochs, each
                                                  predicted from the epochs before it only
    margin  = the ceil((n + 1)(1 - alpha))-th smallest of the n scores
    bound   = min(cap, expm1(mu + margin * sd))   for every response of the next batch

so that, as far as those errors are exchangeable with the next epoch's, at most a share alpha of
responses outlive their bound. A truncated response is recorded at the cap and is covered exactly
by the bounds that reach the cap, so its score is the ordinary one at the cap. With too few
calibration responses (n + 1 < 1 / alpha) the margin is unbounded and every bound is the cap.
With a single epoch of history, the calibration predictions are the population's (each prompt as
if unseen), which is what the predictor knew about that epoch before seeing it. `guarded` shifts
each predictive distribution so that its (1 - alpha) quantile is the bound: the calibrated
distribution the KV-safe layouts size against.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elastic.planning.lengths.predict import LengthDist, Predictor, norm_ppf, score
from elastic.trace import Trace, TraceRecord


@dataclass(frozen=True)
class TailGuard:
    margin: float  # in units of each response's predictive sd; may be +inf
    alpha: float
    calibrated_on: int | None  # the newest epoch whose errors fitted the margin
    cap: int | None

    # Errors of the newest epochs of the history pooled: twice the scores halve the margin's noise.
    CALIBRATION_EPOCHS = 2

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
    def margin_or_none(self) -> float | None:
        """The margin for JSON, which has no infinity: None when every bound is the cap."""
        return None if math.isinf(self.margin) else self.margin

    @property
    def tail_floor(self) -> float:
        """Least chance any response runs to the cap: alpha when the calibration could not bound
        the margin (too few responses), since nothing then says a response stops earlier."""
        return self.alpha if math.isinf(self.margin) else 0.0

    @classmethod
    def fit(cls, history: Trace, alpha: float = 0.05, cap: int | None = None,
            decay: float = 0.7) -> TailGuard:
        if not 0 < alpha < 1:
            raise ValueError(f"TailGuard alpha: expected in (0, 1), got {alpha}")
        epochs = history.epochs
        if not epochs:
            return cls(math.inf, alpha, None, cap)
        cap = cap if cap is not None else Predictor(history).cap
        scores = []
        for c in epochs[-cls.CALIBRATION_EPOCHS:]:
            scores += _scores(history, c, cap, decay)
        scores.sort()
        k = math.ceil((len(scores) + 1) * (1 - alpha))
        margin = scores[k - 1] if k <= len(scores) else math.inf
        return cls(margin, alpha, epochs[-1], cap)


def _scores(history: Trace, c: int, cap: int | None, decay: float) -> list[float]:
    """Standardised errors on epoch c of the predictor fitted on the epochs before c."""
    calib = history.epoch(c)
    prev = history.before(c)
    if len(prev):
        dists = Predictor(prev, cap=cap, decay=decay).predict_batch(calib)
    else:
        pop = Predictor(history.before(c + 1), cap=cap, decay=decay)
        dists = [LengthDist(pop.mu, math.sqrt(pop.sigma2 + pop.tau2), cap, False)] * len(calib)
    return [_score(d, r) for d, r in zip(dists, calib)]


def _score(d: LengthDist, r: TraceRecord) -> float:
    # A truncated response (length recorded at the cap) is covered exactly by the margins whose
    # bound reaches the cap, so the ordinary formula at its recorded length is its score.
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
               "tailguard": {"alpha": alpha, "margin": guard.margin_or_none,
                             "miss_rate": miss_rate(bounds, batch),
                             "mean_bound": float(np.mean(bounds))}}
        rows.append(row)
    return rows


def reserves(dists, guard: TailGuard | None, alpha: float) -> list[float]:
    """Each predicted length's KV reserve: TailGuard's bound where a guard is fitted, else the
    predictor's (1 - alpha) quantile. The planner's rule and the paged cache's admission."""
    return [guard.bound(d) if guard is not None else d.quantile(1 - alpha) for d in dists]


def reserved_lengths(batch, history: Trace, *, tailguard: bool, alpha: float = 0.05) -> list[float]:
    """Each response's length in trace tokens as the planner reserves its KV: TailGuard's bound with
    `tailguard` (once a history can calibrate it), else the predictor's (1 - alpha) quantile; inf
    where nothing bounds it (an empty history: no length is known, so the request's own cap decides,
    not the predictor's empty prior of one token). A paged KV cache admits each response by it,
    whatever the policy."""
    if not len(history):
        return [math.inf] * len(batch)
    pred = Predictor(history)
    guard = TailGuard.fit(history, alpha, cap=pred.cap) if tailguard else None
    return reserves(pred.predict_batch(batch), guard, alpha)
