"""Verifiable rewards: a response and its prompt's reference answer -> a float, with counted outcomes.

Every response gets a reward; nothing here raises on what a model wrote. An answer the verifier
cannot parse, or a prompt without a usable reference, scores `unparsable_reward` (0 by default) and
is counted, so the metrics show how much of a batch was scored blind instead of the run stopping.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from megatron_rl.config import require_seconds
from megatron_rl.rewards.math_answer import (
    CORRECT,
    NO_REFERENCE,
    UNPARSABLE,
    WRONG,
    verify_math,
)

OUTCOMES = (CORRECT, WRONG, UNPARSABLE, NO_REFERENCE)


@dataclass
class RewardConfig:
    # exact: the response (stripped) equals the reference; math: math-verify with sympy fallback.
    kind: Literal["exact", "math"] = "exact"
    correct_reward: float = 1.0
    wrong_reward: float = 0.0
    unparsable_reward: float = 0.0
    # Bound on one math-verify parse or comparison (seconds, main thread only).
    timeout_s: int = 5

    def __post_init__(self) -> None:
        require_seconds(self.timeout_s, "reward.timeout_s")


def exact_match(response: str, reference: str | None) -> str:
    if reference is None or not reference.strip():
        return NO_REFERENCE
    if not response.strip():
        return UNPARSABLE
    return CORRECT if response.strip() == reference.strip() else WRONG


class Scorer:
    """Scores responses and counts outcomes; `take_counts()` returns and resets them per step."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.counts: Counter[str] = Counter()

    def outcome(self, response: str, reference: str | None) -> str:
        if self.cfg.kind == "exact":
            return exact_match(response, reference)
        return verify_math(response, reference, self.cfg.timeout_s)

    def __call__(self, response: str, reference: str | None) -> float:
        return self.credit(self.outcome(response, reference))

    def credit(self, outcome: str) -> float:
        """The reward of an outcome found elsewhere (a scoring lease), counted here."""
        self.counts[outcome] += 1
        if outcome == CORRECT:
            return self.cfg.correct_reward
        if outcome == WRONG:
            return self.cfg.wrong_reward
        return self.cfg.unparsable_reward

    def take_counts(self) -> dict[str, int]:
        counts = {k: self.counts[k] for k in OUTCOMES}
        self.counts.clear()
        return counts


__all__ = ["OUTCOMES", "RewardConfig", "Scorer", "exact_match", "verify_math"]
