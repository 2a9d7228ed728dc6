"""`partial:` in the `train`, `rollout` and `simulate` configs: partial rollouts, off by default.

    partial: {enabled: true, over_sample: 0.25}      # end when the step's groups are complete

A partial rollout launches `prompts x (1 + over_sample)` GRPO groups (rounded up), ends when the
step's groups are complete, and carries the unfinished responses over to the next rollout, which
resumes them under the new policy (docs/training.md, *Partial rollouts*). The rules are
`elastic.planning.partial`'s; this class only holds and checks the fields. `end: budget` (Kimi's
per-rollout token budget per response, `token_budget`) runs in `simulate` only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastic.planning.partial import PartialRule
from megatron_rl.config import require


@dataclass
class PartialConfig:
    enabled: bool = False
    over_sample: float = 0.25  # extra groups launched, as a share of the groups a step trains
    end: Literal["groups", "budget"] = "groups"
    token_budget: int | None = None  # end: budget only, new tokens per response per rollout
    # `train` resuming a partial run's checkpoint with `enabled: false`: drop its carried groups
    # (counted in the log) instead of refusing (rl/checkpoint/partial_state.py).
    drop_carried: bool = False

    def __post_init__(self):
        try:  # also when off: a bad value is a mistake whether or not it is read today
            self.rule()
        except ValueError as e:
            require(False, str(e))

    def rule(self):
        return PartialRule(self.over_sample, self.end, self.token_budget)

    def groups_launched(self, prompts: int) -> int:
        """The GRPO groups one rollout launches for `prompts` that train (as many when off)."""
        return self.rule().launch_count(prompts) if self.enabled else prompts

    def require_groups(self, command: str) -> None:
        require(not self.enabled or self.end == "groups",
                f"partial.end: {command} ends a partial rollout by groups only (got {self.end!r}; "
                "'budget' runs in simulate)")
