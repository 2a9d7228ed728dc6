"""A user's own reward function, called with verl's signature.

    # my_reward.py  (reward.kind: custom, reward.path: my_reward.py, reward.name: compute_score)
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.strip() == ground_truth else 0.0   # or {"score": ..., "acc": ...}

This file is user code that runs by design, in every rank (and in scoring leases): it is imported
from the path the config names and from nowhere else (never from a checkpoint or a run folder).

One call is one outcome. A float (or a dict whose `score` is one) is `scored`; the dict's other
numeric keys are logged as `reward/extra/<key>` (their mean over the responses that returned them).
A call that raises, returns something else or a non-finite score, or runs past `reward.timeout_s`
is `error` and scores `unparsable_reward`: the run goes on, counts it (`reward/outcomes/error`) and
prints the first error once. The bound is a watcher thread (a lease scores off the main thread,
where `signal.alarm` cannot reach): a call past it is abandoned, left to finish in the background.
"""
from __future__ import annotations

import importlib.util
import math
import sys
import threading
from pathlib import Path
from typing import Any, Callable, NamedTuple

from megatron_rl.errors import ConfigError

SCORED, ERROR = "scored", "error"


class Verdict(NamedTuple):
    """What judging one response found: the outcome, and a custom function's score and extras.
    A tuple, so a lease's verdicts travel (pickled, or as JSON lists) unchanged."""

    outcome: str
    score: float | None = None
    extra: dict[str, float] | None = None


def load_reward_function(path: str, name: str) -> Callable[..., Any]:
    """`name` from the Python file `path`; one line naming both if either is not there."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"reward.path {path}: no such file (a Python file defining {name})")
    spec = importlib.util.spec_from_file_location(f"flexfloor_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's module failed at import  # noqa: BLE001
        raise ConfigError(f"reward.path {path}: importing it failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"reward.name {name}: {path} defines no function of that name")
    return fn


class CustomReward:
    """Calls `fn(data_source, solution_str, ground_truth, extra_info)` under the rules above."""

    def __init__(self, fn: Callable[..., Any], timeout_s: float, label: str):
        self.fn, self.timeout_s, self.label = fn, timeout_s, label
        self.reported = False

    def __call__(self, data_source: str, solution: str, ground_truth: str | None, extra_info: dict) -> Verdict:
        box: dict[str, Any] = {}

        def call():
            try:
                box["value"] = self.fn(data_source, solution, ground_truth, extra_info)
            except BaseException as e:  # the user's code: any failure is an outcome  # noqa: BLE001
                box["error"] = f"{type(e).__name__}: {e}"

        worker = threading.Thread(target=call, name="custom-reward", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            return self._error(f"no result within reward.timeout_s {self.timeout_s:g}s")
        if "error" in box:
            return self._error(box["error"])
        return self._verdict(box["value"])

    def _verdict(self, value: Any) -> Verdict:
        extra = None
        if isinstance(value, dict):
            extra = {k: float(v) for k, v in value.items()
                     if k != "score" and isinstance(v, (int, float)) and math.isfinite(v)}
            value = value.get("score")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return self._error(f"returned {value!r:.60}, expected a finite float or a dict with 'score'")
        return Verdict(SCORED, float(value), extra or None)

    def _error(self, what: str) -> Verdict:
        if not self.reported:  # once per process: the count says how often
            self.reported = True
            print(f"[reward] {self.label}: {what} (counted as reward/outcomes/error; further errors "
                  "are only counted)", file=sys.stderr, flush=True)
        return Verdict(ERROR)
