"""A user's own reward function, called with verl's signature, in the run's reward workers.

    # my_reward.py  (reward.kind: custom, reward.path: my_reward.py, reward.name: compute_score)
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.strip() == ground_truth else 0.0   # or {"score": ..., "acc": ...}

The file is user code that runs by design, under the trust rule of `megatron_rl/user_code/`: it is
imported from the path the config names and from nowhere else, and it runs in worker processes
this rank owns (`user_code/pool.py`; one per rank, shared by the reward phase, the scoring leases
and validation). A chdir, an environment change, a leaked thread or a hang stays in the worker.

One call is one outcome. A real number (Python, numpy, a 0-d tensor), or a dict whose `score` is
one, is `scored`; the dict's other real values are logged as `reward/extra/<key>` (their mean over
the responses that returned them; `user_code/reward_kind.py` has the whole contract). A call that
raises (`SystemExit` and `KeyboardInterrupt` too), returns anything else, a non-finite or
overflowing score or a non-string key, ends its worker, or runs past `reward.timeout_s` is `error`
and scores `unparsable_reward`: the run goes on, counts it (`reward/outcomes/error`) and prints
the first error once. A call past the bound ends its worker, which is replaced; after
`STEP_TIMEOUTS` of those in one step the step's other responses score `error` without a call, said
in one line, instead of each waiting out the bound in turn. Whether a step with that many errors
may update the model is `reward.max_error_share`'s (`rewards/error_share.py`).
"""
from __future__ import annotations

import math
import sys
from typing import NamedTuple

from megatron_rl.user_code import REWARD, UserFile
from megatron_rl.user_code.pool import CallResult, shared_pool

SCORED, ERROR = "scored", "error"
# Timeouts in one step after which its other calls are not made: a function that hangs on every
# response would otherwise hold each rank for timeout_s x its share of the responses.
STEP_TIMEOUTS = 3


class Verdict(NamedTuple):
    """What judging one response found: the outcome, and a custom function's score and extras.
    A tuple, so a lease's verdicts travel (pickled, or as JSON lists) unchanged."""

    outcome: str
    score: float | None = None
    extra: dict[str, float] | None = None


class CustomReward:
    """Calls `fn(data_source, solution_str, ground_truth, extra_info)` under the rules above."""

    def __init__(self, path: str, name: str, timeout_s: float):
        self.file = UserFile(REWARD, path, name)
        self.workers = shared_pool(self.file, timeout_s)
        self.reported = False
        self.timeouts = 0  # this step's calls past the bound (`new_step` resets)

    def __call__(self, data_source: str, solution: str, ground_truth: str | None, extra_info: dict) -> Verdict:
        if self.timeouts >= STEP_TIMEOUTS:
            return Verdict(ERROR)
        result = self.workers.call(data_source, solution, ground_truth, extra_info)
        if result.timed_out:
            self.timeouts += 1
            if self.timeouts == STEP_TIMEOUTS:
                print(f"[reward] {self.file.label}: {STEP_TIMEOUTS} calls ran past reward.timeout_s "
                      f"{self.workers.timeout_s:g}s in this step; its other responses here score error "
                      "without a call", file=sys.stderr, flush=True)
        return self._verdict(result)

    def new_step(self) -> None:
        """A new step (or rollout) gets the whole timeout allowance again."""
        self.timeouts = 0

    def _verdict(self, result: CallResult) -> Verdict:
        if result.error is not None:
            return self._error(result.error)
        value = result.value if isinstance(result.value, dict) else {}
        score, extra = value.get("score"), value.get("extra")
        if not (_finite(score) and isinstance(extra, dict) and all(map(_finite, extra.values()))):
            return self._error("its worker sent an answer that is not a score")
        return Verdict(SCORED, float(score), {str(k): float(v) for k, v in extra.items()} or None)

    def _error(self, what: str) -> Verdict:
        if not self.reported:  # once per process: the count says how often
            self.reported = True
            print(f"[reward] {self.file.label}: {what} (counted as reward/outcomes/error; further errors "
                  "are only counted)", file=sys.stderr, flush=True)
        return Verdict(ERROR)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
