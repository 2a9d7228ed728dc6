"""Synthetic length traces with known structure, for tests, benchmarks and the simulator.

A response length is drawn in log space as a sum of independent parts, so each part's share of the
variance is a parameter:

    log L[p, e, s] = log(median) + trend * e + hard[p] + a[p] + d[p, e] + eps[p, e, s]

- `a[p]`: the prompt's persistent effect, variance `prompt_share * sigma**2` (what history can learn);
- `d[p, e]`: drift, a random walk per prompt; each epoch adds variance `drift * sigma**2`, so the
  prompt effect decorrelates slowly across epochs;
- `eps`: the sample's own noise, variance `(1 - prompt_share) * sigma**2` (what nobody can predict);
- `hard[p]`: `log(hard_factor)` for a `hard_share` of the prompts (the bimodal easy/hard mix);
- `trend`: a shift of every length per epoch (DeepScaleR's mean length fell as the policy learned).

Lengths are rounded, floored at 1 and cut at `cap` (`truncated: true` when the draw reached it).
Every epoch holds every prompt with `samples` responses (a GRPO group), in a per-epoch shuffled
prompt order as a data loader would give. The presets are described in docs/planner.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from elastic.trace import Trace, TraceRecord


@dataclass(frozen=True)
class SynthParams:
    prompts: int = 128
    samples: int = 8
    epochs: int = 6
    cap: int = 16384
    median: float = 2500.0
    sigma: float = 0.9
    prompt_share: float = 0.6
    drift: float = 0.02
    trend: float = 0.0
    hard_share: float = 0.0
    hard_factor: float = 1.0
    prompt_len_min: int = 40
    prompt_len_max: int = 400
    prefix: str = "p"

    def __post_init__(self):
        for name in ("prompts", "samples", "epochs", "cap", "prompt_len_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"SynthParams.{name}: expected >= 1, got {getattr(self, name)}")
        if self.prompt_len_max < self.prompt_len_min:
            raise ValueError(f"SynthParams.prompt_len_max ({self.prompt_len_max}) is below "
                             f"prompt_len_min ({self.prompt_len_min})")
        if not 0 <= self.prompt_share <= 1:
            raise ValueError(f"SynthParams.prompt_share: expected in [0, 1], got {self.prompt_share}")
        if not 0 <= self.hard_share <= 1:
            raise ValueError(f"SynthParams.hard_share: expected in [0, 1], got {self.hard_share}")
        for name in ("median", "hard_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SynthParams.{name}: expected > 0, got {getattr(self, name)}")
        for name in ("sigma", "drift"):
            if getattr(self, name) < 0:
                raise ValueError(f"SynthParams.{name}: expected >= 0, got {getattr(self, name)}")


# Presets (docs/planner.md says what each one imitates and why these numbers).
PRESETS: dict[str, SynthParams] = {
    # Math reasoning rollouts: 128 prompts x 8 samples = 1,024 responses per rollout, 16k cap,
    # a long tail from a minority of hard prompts, strong per-prompt persistence, and mean length
    # falling slowly as the policy learns.
    "deepscaler": SynthParams(prompts=128, samples=8, epochs=6, cap=16384, median=2100.0,
                              sigma=0.72, prompt_share=0.72, drift=0.02, trend=-0.03,
                              hard_share=0.1, hard_factor=2.8, prefix="dsr"),
    # Code rollouts: shorter, less tail-heavy, somewhat weaker persistence.
    "eurus": SynthParams(prompts=128, samples=8, epochs=6, cap=8192, median=1000.0, sigma=0.68,
                         prompt_share=0.55, drift=0.03, trend=0.0, hard_share=0.1,
                         hard_factor=2.5, prompt_len_min=100, prompt_len_max=1200, prefix="eurus"),
    # Same lengths as `deepscaler`, but no part of a length belongs to the prompt: history
    # carries no information about the next rollout.
    "nosignal": SynthParams(prompts=128, samples=8, epochs=6, cap=16384, median=2200.0,
                            sigma=0.95, prompt_share=0.0, drift=0.0, trend=0.0, hard_share=0.0,
                            prefix="ns"),
}


def preset(name: str, **overrides) -> SynthParams:
    if name not in PRESETS:
        raise ValueError(f"trace preset: expected one of {', '.join(PRESETS)}, got {name!r}")
    return replace(PRESETS[name], **overrides)


def generate(params: SynthParams, seed: int = 0) -> Trace:
    """Draw a trace; the same `params` and `seed` give the same trace."""
    rng = np.random.default_rng(seed)
    P, S = params.prompts, params.samples
    var = params.sigma ** 2
    width = len(str(P - 1))
    ids = [f"{params.prefix}-{i:0{width}d}" for i in range(P)]
    prompt_len = rng.integers(params.prompt_len_min, params.prompt_len_max + 1, size=P)
    hard = np.where(rng.random(P) < params.hard_share, math.log(params.hard_factor), 0.0)
    effect = rng.normal(0.0, math.sqrt(params.prompt_share * var), size=P) + hard
    noise_sd = math.sqrt((1.0 - params.prompt_share) * var)
    records = []
    for e in range(params.epochs):
        if e:
            effect = effect + rng.normal(0.0, math.sqrt(params.drift * var), size=P)
        loc = math.log(params.median) + params.trend * e + effect
        draws = np.exp(loc[:, None] + rng.normal(0.0, noise_sd, size=(P, S)))
        lengths = np.clip(np.rint(draws), 1, params.cap).astype(int)
        for p in rng.permutation(P):
            for s in range(S):
                L = int(lengths[p, s])
                records.append(TraceRecord(ids[p], e, s, int(prompt_len[p]), L, L >= params.cap))
    return Trace(records, f"<synth seed={seed}>")
