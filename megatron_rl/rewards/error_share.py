"""When a step's rewards are too broken to learn from (`reward.max_error_share`).

A custom reward that fails on most responses (a bug, a package its worker lacks, a hang) scores
them all `unparsable_reward`: the advantages carry no signal, and a run that went on would train on
nothing and exit 0. The rule is judged on each step's outcome counts, summed over the ranks (so
every rank decides alike, with no collective of its own), after the reward phase and before the
update: an `error` share above `reward.max_error_share` stops the run in one line, and
checkpoints/latest stays the last good step. Where the run may go on (`max_error_share: 1`), a step
in which every response scored `error` says so loudly: a line on stderr beside its progress line,
and `reward/all_error` (1) in metrics.jsonl and W&B, a key no other step carries.
"""
from __future__ import annotations

import sys

from megatron_rl.errors import FlexFloorError


class RewardErrors(FlexFloorError):
    """A step in which more responses scored `error` than `reward.max_error_share` allows."""


def check_error_share(step: int, counts: dict[str, int], max_share: float, rank: int) -> dict:
    """Raise `RewardErrors` when step `step`'s `error` share (of `counts`, the step's outcomes over
    every rank) is above `max_share`; else the step's extra metrics: `{"reward_all_error": 1}` when
    every response scored `error` (said on stderr by rank 0), {} otherwise."""
    total, errors = sum(counts.values()), counts.get("error", 0)
    if not errors:
        return {}
    if errors > max_share * total:
        raise RewardErrors(f"step {step}: {errors} of {total} responses scored error (reward/outcomes/error; "
                           "each rank printed its first as a [reward] line), above reward.max_error_share "
                           f"{max_share:g}; stopped before the step's update: checkpoints/latest is the last "
                           "good step")
    if errors < total:
        return {}
    if rank == 0:
        print(f"[train] step {step}: EVERY RESPONSE ({total} of {total}) SCORED error, so the step has no "
              "reward signal (reward/all_error; the [reward] lines say why)", file=sys.stderr, flush=True)
    return {"reward_all_error": 1}
