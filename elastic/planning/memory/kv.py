"""KV-cache demand of a rank over the rollout, for KV-safe layouts.

A rank decodes its responses concurrently and frees a response's KV cache when it ends, so after t
decode steps it holds sum(prompt_i + t) over its live responses. With response i alive past step t
with probability S_i(t) (the survival function of its predictive length distribution), the KV held
over a step interval [t_j, t_j+1) is at most

    D(t_j) = sum_i 1[L_i > t_j] * (prompt_i + t_j+1)

whose mean and variance are sums over the rank's responses. A rank is KV-safe when, at every grid
point, mean + z * sd of D (z the standard normal (1 - alpha) quantile) fits its budget: the KV it
holds exceeds its budget with probability at most about alpha at any one time. Summing each
response's own bound instead (as if all ran to their bound together) would reserve an order of
magnitude more than any rollout uses and reject every realistic batch. With exact lengths (the
oracle, or an empty history where every response is taken to run to the cap) S is 0/1 and D is an
exact upper bound.

The grid is 0, then geometric from 1 token to the longest possible response; the `+ t_j+1` keeps
the bound conservative between grid points (a response alive at t in [t_j, t_j+1) has L_i > t_j and
holds at most prompt_i + t_j+1 tokens). The first interval is certain, not predicted: every
response is prefilled before the first decode step, so all of a rank's prompts (plus one token
each) are held at once whatever the lengths turn out to be. A predictive distribution puts some
mass below one token and an oracle length may be 0; taking S_i(0) from them would count the
prompts only in expectation (a 10-million-token prompt whose responses are predicted short would
fit a rank with room for far less).

Positions are counted as the run's KV cache holds them (`kv_unit.KVUnit`): `prompt_i + t` under
`tokens`, whole pages of it under `paged`, a whole slot under `slots`. Under `paged` the samples of
one GRPO group on a rank hold their prompt's full pages once: each response's curve counts its
positions beyond them, and a rank's demand adds each group's shared pages once, held from the
prefill until the rollout ends (an upper bound: they are freed when the group's last sample ends).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from elastic.planning.lengths.predict import LengthDist, norm_ppf
from elastic.planning.memory.kv_unit import TOKENS, KVUnit, slot_len

# Points of the step grid the demand curves are evaluated on (geometric, from one step to the longest).
DEMAND_POINTS = 40


class Demand:
    """Per-response KV demand curves (in KV positions of `unit`) on a shared step grid. `group`:
    each response's GRPO group (its prompt), whose samples on one rank share the prompt's full
    pages under `paged`; None: nothing is shared."""

    def __init__(self, dists: Sequence[LengthDist], prompt_len: Sequence[float], alpha: float,
                 tail_floor: float = 0.0, unit: KVUnit = TOKENS, group: Sequence | None = None):
        mu = np.array([d.mu for d in dists], float)
        sd = np.array([d.sd for d in dists], float)
        cap = np.array([d.cap or math.inf for d in dists], float)
        top = float(np.max(np.where(np.isfinite(cap), cap, np.expm1(mu + 8 * sd)))) if len(mu) else 1.0
        edges = np.concatenate([[0.0], np.geomspace(1.0, max(top, 2.0), DEMAND_POINTS)])
        t, t_next = edges[:-1], edges[1:]
        with np.errstate(divide="ignore", invalid="ignore"):
            zs = (np.log1p(t)[None, :] - mu[:, None]) / sd[:, None]
        zs = np.where(sd[:, None] > 0, zs, np.where(np.log1p(t)[None, :] < mu[:, None], -np.inf, np.inf))
        surv = 0.5 * _erfc(zs / math.sqrt(2.0))
        # A calibration that saw more than alpha of responses run to the cap: every response may.
        surv = np.maximum(surv, tail_floor)
        surv = np.where(t[None, :] < cap[:, None], surv, 0.0)
        surv[:, 0] = 1.0  # every response holds its prompt from prefill on (module docstring)
        self.prompt = np.asarray(prompt_len, float)
        # A slot holds the longest sequence: the longest prompt and the longest possible response.
        slot = slot_len(self.prompt, edges[-1])
        shared = unit.shared(self.prompt) if group is not None else np.zeros(len(self.prompt))
        tokens = unit.held(self.prompt[:, None], t_next[None, :], slot) - shared[:, None]
        # Each group's shared positions, counted once per rank that holds one of its samples.
        self.shared, self.sharing = shared, bool(np.any(shared))
        if self.sharing:
            self.group = np.unique(np.asarray([repr(g) for g in group]), return_inverse=True)[1]
        self.mean = surv * tokens
        self.var = surv * (1.0 - surv) * tokens**2
        self.z = norm_ppf(1.0 - alpha)

    def own_peaks(self) -> np.ndarray:
        """Each response's peak demand on its own (KV positions, its shared prompt pages included)."""
        if not len(self.mean):
            return np.zeros(0)
        return np.max(self.mean + self.z * np.sqrt(self.var), axis=1) + self.shared

    def peak(self, idx: Sequence[int]) -> float:
        idx = list(idx)
        if not idx:
            return 0.0
        m = self.mean[idx].sum(axis=0)
        v = self.var[idx].sum(axis=0)
        peak = float(np.max(m + self.z * np.sqrt(v)))
        if not self.sharing:
            return peak
        # Each group's shared pages once (the first of its responses here names the group's).
        _, first = np.unique(self.group[idx], return_index=True)
        return peak + float(self.shared[np.asarray(idx)[first]].sum())


class RankKV:
    """Running KV demand of every rank as responses are placed.

    `fits` first tries a cheap sufficient test: max_t(a + b) <= max_t a + max_t b and
    sqrt(V + v) <= sqrt(V) + sqrt(v), so a rank's peak plus the response's own peak bounds the new
    peak; only when that bound does not fit is the exact curve summed.
    """

    def __init__(self, demand: Demand, budget: Sequence[float]):
        self.d = demand
        # Plain lists: the placing loops index them once per response.
        self.own = demand.own_peaks().tolist()
        self.upper = [0.0] * len(budget)
        self.budget = [float(b) for b in budget]
        self.members: list[list[int]] = [[] for _ in budget]

    def fits(self, r: int, i: int) -> bool:
        if self.upper[r] + self.own[i] <= self.budget[r]:
            return True
        exact = self.d.peak(self.members[r] + [i])
        if exact <= self.budget[r]:
            return True
        # Tighten the bound to the rank's exact peak, so the next look is cheap again.
        self.upper[r] = self.d.peak(self.members[r])
        return False

    def add(self, r: int, i: int) -> None:
        self.upper[r] += self.own[i]
        self.members[r].append(i)

    def room(self) -> float:
        return float(max(b - self.d.peak(m) for b, m in zip(self.budget, self.members)))


def _erfc(x: np.ndarray) -> np.ndarray:
    """Complementary error function (Numerical Recipes' erfcc, |relative error| < 1.2e-7)."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    with np.errstate(invalid="ignore", over="ignore"):
        r = t * np.exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
            -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
                -0.82215223 + t * 0.17087277)))))))))
    r = np.where(np.isinf(z), 0.0, r)
    return np.where(x >= 0, r, 2.0 - r)
