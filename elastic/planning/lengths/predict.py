"""History-based length prediction: a predictive distribution per prompt from earlier epochs only.

The model works on y = log(1 + length), where response lengths are close to normal:

    y[p, e, s] = mu + a[p] + eps,   a[p] ~ N(0, tau2)  (the prompt),   eps ~ N(0, sigma2)  (the sample)

fitted by moments from the history (a random-effects model). A prompt's prediction is its own
recency-weighted mean shrunk toward the population mean `mu` by the usual precision weights, so a
prompt seen once moves little and an unseen prompt gets the population distribution. Three details:
- truncation: a length cut at the cap is a lower bound, so it enters as E[y | y >= log(1 + cap)]
  under the current fit (two EM-style passes), never as the value itself;
- drift: older epochs weigh `decay ** age`, and every epoch is re-centred on the newest epoch's
  mean, so a population trend (mean length falling as the policy learns) lags one epoch, not all;
- leakage: a `Predictor` reads only the `Trace` it is given; `Predictor.for_epoch(trace, e)` gives
  it `trace.before(e)`. It never sees a length of the batch it predicts.

`LengthDist.icc` (tau2 / (tau2 + sigma2)) is the share of length variance that belongs to the
prompt: near 0, history carries no signal and the planner should not trust the ranking.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from elastic.trace import Trace, TraceRecord

_MIN_VAR = 1e-4


@dataclass(frozen=True)
class LengthDist:
    """Predictive distribution of one response's length: log(1 + L) ~ N(mu, sd**2), cut at cap."""

    mu: float
    sd: float
    cap: int | None
    seen: bool  # the prompt has history of its own

    def quantile(self, p: float) -> float:
        q = math.expm1(self.mu + self.sd * norm_ppf(p))
        return min(max(q, 1.0), self.cap) if self.cap else max(q, 1.0)

    @property
    def median(self) -> float:
        return self.quantile(0.5)


class Predictor:
    def __init__(self, history: Trace, cap: int | None = None, decay: float = 0.7):
        if not 0 < decay <= 1:
            raise ValueError(f"decay: expected in (0, 1], got {decay}")
        records = list(history)
        self.cap = cap if cap is not None else infer_cap(records)
        self.decay = decay
        self._means: dict[str, tuple[float, float]] = {}  # prompt -> (posterior mean, its variance)
        if not records:
            self.mu, self.tau2, self.sigma2 = 0.0, 0.0, 0.0
            self.empty = True
            return
        self.empty = False
        self._fit(records)

    @classmethod
    def for_epoch(cls, trace: Trace, epoch: int, **kw) -> Predictor:
        return cls(trace.before(epoch), **kw)

    @property
    def icc(self) -> float:
        total = self.tau2 + self.sigma2
        return self.tau2 / total if total > 0 else 0.0

    def predict(self, prompt_id: str) -> LengthDist:
        if self.empty:
            # Nothing is known: every response is alike and may run to the cap.
            mu = math.log1p(self.cap) if self.cap else 0.0
            return LengthDist(mu, 0.0, self.cap, False)
        if prompt_id in self._means:
            m, v = self._means[prompt_id]
            return LengthDist(m, math.sqrt(self.sigma2 + v), self.cap, True)
        return LengthDist(self.mu, math.sqrt(self.sigma2 + self.tau2), self.cap, False)

    def predict_batch(self, batch: Iterable) -> list[LengthDist]:
        return [self.predict(r.prompt_id) for r in batch]

    # ---- fitting -----------------------------------------------------------------------------
    def _fit(self, records: list[TraceRecord]) -> None:
        pids = sorted({r.prompt_id for r in records})
        index = {p: i for i, p in enumerate(pids)}
        last = max(r.epoch for r in records)
        g = np.array([index[r.prompt_id] for r in records])
        ep = np.array([r.epoch for r in records])
        y = np.log1p(np.array([r.response_len for r in records], dtype=float))
        cut = np.array([r.truncated for r in records])
        w = self.decay ** (last - ep).astype(float)
        ycap = math.log1p(self.cap) if self.cap else math.inf
        P = len(pids)
        wsum = np.bincount(g, w, P)
        obs = y.copy()
        for _ in range(3):
            # Re-centre each epoch on the newest one, then average per prompt.
            shift = _epoch_means(obs, ep)
            yc = obs - shift[ep] + shift[last]
            m = np.bincount(g, w * yc, P) / wsum
            resid = yc - m[g]
            dof = max(w.sum() - wsum.size, 1.0)
            sigma2 = max(float(np.sum(w * resid**2) / dof), _MIN_VAR)
            if not cut.any():
                break
            # A truncated length only says y >= ycap: use its conditional mean under the fit.
            loc = (m[g] + shift[ep] - shift[last])[cut]
            obs[cut] = _upper_tail_mean(loc, math.sqrt(sigma2), ycap)
        self.sigma2 = sigma2
        # Effective number of observations per prompt under the recency weights (Kish).
        n_eff = wsum**2 / np.bincount(g, w**2, P)
        self.mu = float(np.mean(m))
        noise = float(np.mean(sigma2 / n_eff))
        self.tau2 = max(float(np.var(m)) - noise, _MIN_VAR) if P > 1 else _MIN_VAR
        prec = n_eff / sigma2 + 1.0 / self.tau2
        post = (n_eff / sigma2 * m + self.mu / self.tau2) / prec
        self._means = {p: (float(post[i]), float(1.0 / prec[i])) for i, p in enumerate(pids)}


def infer_cap(records: Sequence[TraceRecord]) -> int | None:
    """The cap a trace was generated under: the length of its truncated responses, if any."""
    cut = [r.response_len for r in records if r.truncated]
    return max(cut) if cut else None


def _epoch_means(y: np.ndarray, ep: np.ndarray) -> np.ndarray:
    size = int(ep.max()) + 1
    counts = np.bincount(ep, minlength=size)
    sums = np.bincount(ep, y, size)
    return np.divide(sums, counts, out=np.zeros(size), where=counts > 0)


def _upper_tail_mean(m: np.ndarray, s: float, c: float) -> np.ndarray:
    a = (c - m) / s
    tail = np.array([0.5 * math.erfc(x / math.sqrt(2)) for x in a])
    pdf = np.exp(-0.5 * a**2) / math.sqrt(2 * math.pi)
    # Far in the tail the inverse Mills ratio tends to a; use that where the tail underflows.
    ratio = np.where(tail > 1e-300, pdf / np.maximum(tail, 1e-300), a)
    return np.maximum(m + s * ratio, c)


_PPF_A = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
          1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00)
_PPF_B = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
          6.680131188771972e01, -1.328068155288572e01)
_PPF_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
          -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00)
_PPF_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
_PPF_LO = 0.02425


@functools.lru_cache(maxsize=256)
def norm_ppf(p: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9)."""
    if not 0 < p < 1:
        raise ValueError(f"quantile level: expected in (0, 1), got {p}")
    return float(norm_ppf_array(np.array([p]))[0])


def norm_ppf_array(p: np.ndarray) -> np.ndarray:
    """`norm_ppf` elementwise over an array of levels in (0, 1) (the online model samples with it)."""
    p = np.asarray(p, dtype=np.float64)
    a, b, c, d = _PPF_A, _PPF_B, _PPF_C, _PPF_D
    tail = np.minimum(p, 1 - p)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.sqrt(-2 * np.log(np.maximum(tail, 1e-300)))
        xt = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
        xt = np.where(p < 0.5, xt, -xt)
        m = p - 0.5
        r = m * m
        xc = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * m / \
            (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    return np.where(tail < _PPF_LO, xt, xc)


def log_norm_sf(x: np.ndarray) -> np.ndarray:
    """log(1 - Phi(x)) elementwise, finite far into the upper tail: Numerical Recipes' erfcc
    (relative error < 1.2e-7) has the form t * exp(-z**2 + poly(t)), whose log never underflows."""
    x = np.asarray(x, dtype=np.float64)
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    log_upper = math.log(0.5) + np.log(t) - z * z + poly  # log Q(|x|)
    return np.where(x >= 0, log_upper, np.log1p(-np.exp(log_upper)))


# ---- quality ---------------------------------------------------------------------------------
def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); 0.0 when either side is constant."""
    rx, ry = _ranks(np.asarray(x, float)), _ranks(np.asarray(y, float))
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="mergesort")
    sv = v[order]
    ranks = np.empty(len(v))
    i = 0
    while i < len(v):
        j = i
        while j + 1 < len(v) and sv[j + 1] == sv[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0
        i = j + 1
    return ranks


def score(dists: Sequence[LengthDist], actual: Sequence[TraceRecord],
          levels: Sequence[float] = (0.5, 0.9)) -> dict:
    """Quality of predictions against the true lengths of the same responses.

    `calibration[q]` is the share of responses at or below their predicted q-quantile: a
    calibrated predictor gives about q. A truncated response counts as covered only by a
    quantile at the cap (its true length is at least the cap).
    """
    pred = np.array([d.median for d in dists])
    true = np.array([r.response_len for r in actual], float)
    cal = {}
    for q in levels:
        qs = np.array([d.quantile(q) for d in dists])
        cal[f"{q:g}"] = float(np.mean(true <= qs))
    return {
        "responses": len(actual),
        "spearman": spearman(pred, true),
        "mae": float(np.mean(np.abs(pred - true))),
        "calibration": cal,
    }
