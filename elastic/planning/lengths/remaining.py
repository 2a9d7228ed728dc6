"""Online re-prediction: each live response's remaining length, re-estimated while the rollout runs.

Before the rollout, `predict.Predictor` gives every response a predictive distribution
log(1 + L) ~ N(mu, sd**2) from the history. While it runs, two more things are known:

- the tokens a live response has generated so far, ell: its length is now known to exceed ell
  (the predictive distribution conditioned on L > ell, its survival beyond ell);
- the lengths of its finished siblings, the same prompt's other samples in this batch, and the
  tokens so far of its live siblings (each again a lower bound).

On the standardised residual z = (log(1 + L) - mu) / sd the model is

    z[i] = bias + b[p] + e[i],    b[p] ~ N(0, icc * scale**2),    e[i] ~ N(0, (1 - icc) * scale**2)

with `b[p]` what one prompt's samples share in this rollout beyond the history's prediction.
`SiblingFit.fit` estimates `bias`, `scale` and `icc` (how much siblings tell) from the history
itself: the same predictor's standardised errors on the newest history epochs, each predicted from
the epochs before it (as TailGuard calibrates), split by a one-way random-effects analysis into a
part shared within a prompt's group and the sample's own. Nothing is tuned to a trace generator: on
a trace whose prompts carry no signal the fitted icc is about 0 and siblings are ignored.

`b[p]` has a posterior on a fixed grid, exact for this model: each finished sibling adds its
density, each live one (and a truncated one, cut at the cap) its survival. Remaining lengths are
sampled from it: a grid point per prompt, then each live response's z from the normal above
truncated to its own lower bound.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elastic.planning.lengths.predict import LengthDist, Predictor, log_norm_sf, norm_ppf, norm_ppf_array
from elastic.trace import Trace

# Values of a GRPO group's shared effect (in standard deviations) its posterior is computed on.
EFFECT_GRID = np.linspace(-4.0, 4.0, 33)
# Residual scale of a response whose predictive distribution has no spread (an empty history puts
# every response at the cap): small, so its prediction stands until its tokens say otherwise.
_MIN_SD = 1e-3


@dataclass(frozen=True)
class SiblingFit:
    icc: float  # share of the residual variance one prompt's samples share within a rollout
    bias: float  # mean standardised residual (a predictor running short or long)
    scale: float  # sd of the standardised residuals (1: the predictive sd was right)
    responses: int  # how many history responses the fit saw

    CALIBRATION_EPOCHS = 2

    @classmethod
    def neutral(cls) -> SiblingFit:
        """Nothing learned: the predictive distributions as they are, siblings independent."""
        return cls(0.0, 0.0, 1.0, 0)

    @classmethod
    def fit(cls, history: Trace, cap: int | None = None, decay: float = 0.7) -> SiblingFit:
        epochs = history.epochs
        if len(epochs) < 1:
            return cls.neutral()
        zs: list[float] = []
        groups: list[tuple[int, str]] = []
        for c in epochs[-cls.CALIBRATION_EPOCHS:]:
            calib, prev = history.epoch(c), history.before(c)
            if len(prev):
                dists = Predictor(prev, cap=cap, decay=decay).predict_batch(calib)
            else:  # the first epoch: what was known before it, the population
                pop = Predictor(history.before(c + 1), cap=cap, decay=decay)
                dists = [LengthDist(pop.mu, math.sqrt(pop.sigma2 + pop.tau2), cap, False)] * len(calib)
            for d, r in zip(dists, calib):
                if d.sd > 0:
                    zs.append((math.log1p(r.response_len) - d.mu) / d.sd)
                    groups.append((c, r.prompt_id))
        if len(zs) < 4:
            return cls.neutral()
        z = np.array(zs)
        index = {g: i for i, g in enumerate(dict.fromkeys(groups))}
        g = np.array([index[k] for k in groups])
        n = np.bincount(g).astype(float)
        G, N = len(n), len(z)
        means = np.bincount(g, z) / n
        within = float(np.sum((z - means[g]) ** 2) / max(N - G, 1))
        between = float(np.sum(n * (means - z.mean()) ** 2) / max(G - 1, 1))
        n0 = (N - float(np.sum(n**2)) / N) / max(G - 1, 1)
        shared = max((between - within) / n0, 0.0) if n0 > 0 else 0.0
        total = shared + within
        icc = min(shared / total, 0.95) if total > 0 else 0.0
        return cls(icc, float(z.mean()), math.sqrt(total) if total > 0 else 1.0, N)

    def to_dict(self) -> dict:
        return {"icc": round(self.icc, 4), "bias": round(self.bias, 4), "scale": round(self.scale, 4),
                "responses": self.responses}


@dataclass(frozen=True)
class OnlineOptions:
    """Which evidence the online model uses (each can be switched off for an ablation)."""

    conditional: bool = True  # condition on the tokens generated so far
    siblings: bool = True  # pool the evidence of a prompt's samples
    migrate: bool = True  # the decision rule may move live requests off leaving ranks

    @property
    def suffix(self) -> str:
        off = [n for n in ("conditional", "siblings", "migrate") if not getattr(self, n)]
        return "".join(f" -{n}" for n in off)


class OnlineModel:
    """Remaining-length distributions of a batch's responses (index = the batch's order)."""

    def __init__(self, dists: Sequence[LengthDist], prompts: Sequence[str], fit: SiblingFit,
                 options: OnlineOptions = OnlineOptions()):
        self.mu = np.array([d.mu for d in dists], float)
        self.sd = np.maximum(np.array([d.sd for d in dists], float), _MIN_SD)
        caps = {d.cap for d in dists}
        self.cap = min((c for c in caps if c), default=None)
        self.fit, self.options = fit, options
        if options.siblings:
            index = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
            self.group = np.array([index[p] for p in prompts], dtype=np.int64)
            icc = fit.icc
        else:
            self.group = np.arange(len(dists), dtype=np.int64)
            icc = 0.0
        self.groups = int(self.group.max()) + 1 if len(self.group) else 0
        self.b = math.sqrt(icc) * fit.scale * EFFECT_GRID  # grid of the shared effect, in z units
        log_prior = -0.5 * EFFECT_GRID**2
        self.log_prior = log_prior - log_prior.max()
        self.noise = math.sqrt(max(1.0 - icc, 1e-6)) * fit.scale

    def posterior(self, tokens: np.ndarray, done: np.ndarray) -> np.ndarray:
        """(groups, grid) posterior weights of each prompt's shared effect.

        `tokens[i]`: tokens response i has generated (its length once `done[i]`)."""
        tokens = np.asarray(tokens, float)
        done = np.asarray(done, bool)
        loc = self.fit.bias + self.b[None, :]
        cut = done & (tokens >= (self.cap or math.inf))
        exact = done & ~cut
        # A live response is longer than its tokens so far (half a token: lengths are integers).
        bound = np.where(done, tokens, tokens + 0.5)
        z = (np.log1p(bound) - self.mu) / self.sd
        ll = np.zeros((len(tokens), len(self.b)))
        ll[exact] = -0.5 * ((z[exact, None] - loc) / self.noise) ** 2
        lower = ~exact if self.options.conditional else cut
        ll[lower] = log_norm_sf((z[lower, None] - loc) / self.noise)
        # Every (group, grid point)'s log-likelihoods summed in response order (one bincount over
        # the rows, as np.add.at would, but fast), then added to the prior.
        grid = len(self.b)
        bins = (self.group[:, None] * grid + np.arange(grid)).ravel()
        post = np.tile(self.log_prior, (self.groups, 1))
        post += np.bincount(bins, ll.ravel(), minlength=self.groups * grid).reshape(self.groups, grid)
        post -= post.max(axis=1, keepdims=True)
        w = np.exp(post)
        return w / w.sum(axis=1, keepdims=True)

    def sample_remaining(self, idx: np.ndarray, tokens: np.ndarray, done: np.ndarray, samples: int,
                         rng: np.random.Generator) -> np.ndarray:
        """(samples, len(idx)) remaining tokens (>= 1) of the live responses `idx`, drawn jointly
        (siblings share their prompt's effect within a sample)."""
        idx = np.asarray(idx, dtype=np.int64)
        if not len(idx):
            return np.zeros((samples, 0))
        w = self.posterior(tokens, done)
        groups = np.flatnonzero(np.bincount(self.group[idx], minlength=self.groups))  # sorted, once each
        cum = np.cumsum(w[groups], axis=1)
        u = rng.random((samples, len(groups)))
        pick = np.minimum((cum[None, :, :] < u[:, :, None] * cum[None, :, -1:]).sum(axis=2), len(self.b) - 1)
        at = np.searchsorted(groups, self.group[idx])
        loc = self.fit.bias + self.b[pick[:, at]]  # (samples, live)
        ell = np.asarray(tokens, float)[idx]
        if self.options.conditional:
            a = ((np.log1p(ell + 0.5) - self.mu[idx]) / self.sd[idx] - loc) / self.noise
            # Inverse survival: z = loc + noise * Q^-1(u * Q(a)), in logs so a far tail stays finite.
            log_u = np.log(rng.random(loc.shape)) + log_norm_sf(a)
            z = loc - self.noise * norm_ppf_array(np.exp(np.maximum(log_u, -700.0)))
            z = np.maximum(z, loc + self.noise * a)
        else:
            z = loc + self.noise * rng.standard_normal(loc.shape)
        length = np.expm1(self.mu[idx] + self.sd[idx] * z)
        if self.cap is not None:
            length = np.minimum(length, self.cap)
        return np.maximum(np.rint(length) - ell, 1.0)


def online_model(batch: Sequence, history: Trace, cap: int | None,
                 options: OnlineOptions = OnlineOptions(),
                 known_prefix: dict[tuple[str, int], int] | None = None) -> OnlineModel:
    """The online model of a batch (objects with `prompt_id`) from its history (earlier epochs only).

    `known_prefix`: tokens so far of responses resumed from an earlier rollout (partial rollouts);
    their tokens in this rollout count from 0, so each is modelled by what is left of it
    (`conditioned`), and conditioning on this rollout's tokens then continues from there."""
    pred = Predictor(history, cap=cap)
    fit = SiblingFit.fit(history, cap=pred.cap) if not pred.empty else SiblingFit.neutral()
    dists = pred.predict_batch(batch)
    if known_prefix:
        dists = [conditioned(d, known_prefix.get((b.prompt_id, b.sample), 0)) for d, b in zip(dists, batch)]
    return OnlineModel(dists, [b.prompt_id for b in batch], fit, options)


def conditioned(dist: LengthDist, tokens: int) -> LengthDist:
    """The distribution of the remaining length R = L - tokens of a response with `tokens` so far,
    given L > tokens (`OnlineModel.sample_remaining`'s conditioning),
    summarised as a `LengthDist` with the same median and 90% quantile (so every planner check
    that reads a `LengthDist` prices what is left). The cap becomes the tokens still allowed."""
    if tokens <= 0:
        return dist
    cap = None if dist.cap is None else max(int(dist.cap) - tokens, 1)
    if dist.sd <= 0:
        return LengthDist(math.log1p(max(math.expm1(dist.mu) - tokens, 1.0)), 0.0, cap, dist.seen)
    # Upper-tail levels of L | L > tokens: P(L > q_p | L > t) = 1 - p, i.e. Q(z_p) = S(t) (1 - p).
    log_s = float(log_norm_sf(np.array([(math.log1p(tokens + 0.5) - dist.mu) / dist.sd]))[0])
    levels = np.exp(log_s + np.log([0.5, 0.1]))
    z = -norm_ppf_array(np.maximum(levels, 1e-300))
    length = np.expm1(dist.mu + dist.sd * z)
    if dist.cap is not None:
        length = np.minimum(length, dist.cap)
    rem = np.maximum(length - tokens, 1.0)
    mu = math.log1p(rem[0])
    sd = max((math.log1p(rem[1]) - mu) / norm_ppf(0.9), 0.0)
    return LengthDist(mu, sd, cap, dist.seen)
