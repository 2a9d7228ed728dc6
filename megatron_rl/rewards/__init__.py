"""Verifiable rewards: a response and its prompt's reference answer -> a float, with counted outcomes.

Every response gets a reward; nothing here raises on what a model wrote. An answer the verifier
cannot parse, or a prompt without a usable reference, scores `unparsable_reward` (0 by default) and
is counted, so the metrics show how much of a batch was scored blind instead of the run stopping.

Which verifier judges a response: `reward.kind: custom` calls the user's function (verl's
`compute_score` signature, `rewards/custom.py`) for every prompt; otherwise `reward.sources` maps a
prompt's `data_source` to a built-in one (`exact`, `math`), and `reward.kind` judges the rest.

Where each runs: the built-in verifiers are ours, never raise on what a model wrote, and are
bounded where they could be slow (the math fallback parses only short filtered arithmetic;
math-verify has its own alarm), so they run in the rank, with no process in between. A custom
function is user code: it runs in the rank's reward workers (`megatron_rl/user_code/`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config import require, require_seconds
from megatron_rl.rewards.custom import ERROR, SCORED, CustomReward, Verdict
from megatron_rl.rewards.error_share import RewardErrors, check_error_share
from megatron_rl.rewards.math_answer import (
    CORRECT,
    NO_REFERENCE,
    UNPARSABLE,
    WRONG,
    verify_math,
)
from megatron_rl.user_code import REWARD, UserFile
from megatron_rl.user_code.pool import WorkerPool

OUTCOMES = (CORRECT, WRONG, UNPARSABLE, NO_REFERENCE, SCORED, ERROR)
BUILT_IN = ("exact", "math")


@dataclass
class RewardConfig:
    # exact: the response (stripped) equals the reference; math: math-verify with sympy fallback;
    # custom: `name` from the Python file `path`, called as verl calls compute_score.
    kind: Literal["exact", "math", "custom"] = "exact"
    correct_reward: float = 1.0
    wrong_reward: float = 0.0
    unparsable_reward: float = 0.0  # also what a custom function's error scores
    # Bound on one math-verify parse or comparison (main thread only), or one custom call (seconds).
    timeout_s: int = 5
    path: str | None = None  # custom: the reward file (user code, run by design; docs/training.md)
    name: str = "compute_score"
    # data_source -> built-in verifier for those prompts (e.g. {"openai/gsm8k": math}); not with custom.
    sources: dict[str, str] = field(default_factory=dict)
    # A step whose share of `error` outcomes (a custom function that raised, hung, returned no
    # score) is above this stops the run before the step's update (rewards/error_share.py); 1: never.
    max_error_share: float = 0.5

    def __post_init__(self) -> None:
        require_seconds(self.timeout_s, "reward.timeout_s")
        require(self.kind in (*BUILT_IN, "custom"),
                f"reward.kind: expected exact, math or custom, got {self.kind!r}")
        require((self.kind == "custom") == bool(self.path),
                "reward.path: needed by reward.kind custom (a Python file defining reward.name), "
                f"and only by it (kind is {self.kind!r})")
        bad = {k: v for k, v in self.sources.items() if v not in BUILT_IN}
        require(not bad, f"reward.sources: {next(iter(bad), '')!r} maps to {next(iter(bad.values()), '')!r}; "
                         "expected exact or math")
        require(not (self.sources and self.kind == "custom"),
                "reward.sources: a custom reward function judges every source itself (route in it)")
        require(0 <= self.max_error_share <= 1,
                f"reward.max_error_share: expected a share in [0, 1], got {self.max_error_share:g}")


def exact_match(response: str, reference: str | None) -> str:
    if reference is None or not reference.strip():
        return NO_REFERENCE
    if not response.strip():
        return UNPARSABLE
    return CORRECT if response.strip() == reference.strip() else WRONG


class Scorer:
    """Scores responses and counts outcomes; `take_counts()` returns and resets them per step, and
    `take_extras()` the (sum, count) of each extra key a custom function returned."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.counts: Counter[str] = Counter()
        self.extras: dict[str, list[float]] = {}
        self.custom = CustomReward(cfg.path, cfg.name, cfg.timeout_s) if cfg.kind == "custom" else None

    def verdict(self, response: str, reference: str | None, data_source: str = "",
                extra_info: dict | None = None) -> Verdict:
        """Judge one response (nothing counted: a lease judges, the reward phase credits)."""
        if self.custom is not None:
            return self.custom(data_source, response, reference, extra_info or {})
        if self.cfg.sources.get(data_source, self.cfg.kind) == "exact":
            return Verdict(exact_match(response, reference))
        return Verdict(verify_math(response, reference, self.cfg.timeout_s))

    def judge(self, response: str, prompt) -> Verdict:
        """`verdict` for a dataset `Prompt` (its answer, data_source and extra_info)."""
        return self.verdict(response, prompt.answer, prompt.data_source, prompt.extra_info)

    def __call__(self, response: str, reference: str | None, data_source: str = "",
                 extra_info: dict | None = None) -> float:
        return self.credit(self.verdict(response, reference, data_source, extra_info))

    def credit(self, verdict: Verdict) -> float:
        """The reward of a verdict found here or elsewhere (a scoring lease), counted here."""
        verdict = Verdict(*verdict)  # a lease's verdict may arrive as a plain list
        self.counts[verdict.outcome] += 1
        for k, v in (verdict.extra or {}).items():
            acc = self.extras.setdefault(k, [0.0, 0])
            acc[0] += v
            acc[1] += 1
        if verdict.outcome == SCORED:
            return verdict.score
        if verdict.outcome == CORRECT:
            return self.cfg.correct_reward
        if verdict.outcome == WRONG:
            return self.cfg.wrong_reward
        return self.cfg.unparsable_reward

    def take_counts(self) -> dict[str, int]:
        """This step's outcome counts; the next step starts afresh (its counts, and `new_step`)."""
        counts = {k: self.counts[k] for k in OUTCOMES}
        self.counts.clear()
        self.new_step()
        return counts

    def new_step(self) -> None:
        """A custom function's allowance of timeouts starts afresh (`take_counts` does this for the
        reward phase; a lease's scorer, which counts nothing, at each rollout)."""
        if self.custom is not None:
            self.custom.new_step()

    def take_extras(self) -> dict[str, tuple[float, int]]:
        extras = {k: (s, int(n)) for k, (s, n) in self.extras.items()}
        self.extras.clear()
        return extras


def check_reward_file(cfg: RewardConfig) -> None:
    """A custom reward file imports, in a worker as the ranks will import it (a `sys.exit`, a hang
    or a crash at import is one line naming reward.path), before any rank starts."""
    if cfg.kind == "custom":
        with WorkerPool(UserFile(REWARD, cfg.path, cfg.name), cfg.timeout_s) as workers:
            workers.check_import()


def mean_extras(local: dict[str, tuple[float, int]], world: int) -> dict[str, float]:
    """The mean of each extra key over every rank's responses that returned it (a collective:
    every rank calls it, with whatever keys its own responses gave)."""
    parts = [local]
    if world > 1:
        import torch.distributed as dist

        parts = [None] * world
        dist.all_gather_object(parts, local)
    sums: dict[str, list[float]] = {}
    for part in parts:
        for k, (s, n) in part.items():
            acc = sums.setdefault(k, [0.0, 0])
            acc[0] += s
            acc[1] += n
    return {k: s / n for k, (s, n) in sorted(sums.items()) if n}


__all__ = ["OUTCOMES", "RewardConfig", "RewardErrors", "Scorer", "Verdict", "check_error_share", "check_reward_file",
           "mean_extras", "exact_match", "verify_math"]
