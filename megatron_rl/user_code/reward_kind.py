"""The reward kind of user file: what a reward function may return (verl's `compute_score`
contract), judged in its worker.

A score is a real number: a Python int or float, a Decimal or Fraction, a numpy scalar, or a 0-d
array or tensor (numpy, torch: read with `.item()`), or a dict whose `score` is one. The dict's keys
must be strings; its other real values are logged as `reward/extra/<key>`; its other values (text,
lists: verl's extra info) go no further. A bool, a non-finite value, a number no float holds
(`10**400`) and anything else are `BadReturn`, which the run counts as the call's error.

This module runs in the worker, beside the user's code, so it imports nothing heavy: numpy and
torch values are recognised by their shape and `.item()`, not by importing those packages.
"""
from __future__ import annotations

import decimal
import math
import numbers
from typing import Any

from elastic.errors import shorten
from megatron_rl.user_code.kinds import BadReturn, UserCodeKind

MAX_EXTRAS = 64  # real-valued keys besides `score`, each a metric of every step
MAX_KEY = 64  # characters of a key (a W&B metric name's last part)
EXPECTED = "expected a real number (Python, numpy or a 0-d tensor) or a dict with a real 'score'"


def reward_result(value: Any) -> dict[str, Any]:
    """`{"score": float, "extra": {key: float}}` from what the function returned, or `BadReturn`."""
    if isinstance(value, dict):
        return _from_dict(value)
    score = real(value, "")
    if score is None:
        raise BadReturn(f"returned {_show(value)}, {EXPECTED}")
    return {"score": score, "extra": {}}


def _from_dict(value: dict) -> dict[str, Any]:
    bad = next((k for k in value if not isinstance(k, str) or not 0 < len(k) <= MAX_KEY), None)
    if bad is not None:
        raise BadReturn(f"returned a dict with the key {_show(bad)}; keys must be strings of 1 to "
                        f"{MAX_KEY} characters")
    if "score" not in value:
        raise BadReturn(f"returned a dict without 'score' (keys: {shorten(', '.join(value), 80)}), {EXPECTED}")
    score = real(value["score"], "'score' ")
    if score is None:
        raise BadReturn(f"returned a dict whose 'score' is {_show(value['score'])}, {EXPECTED}")
    extra = {}
    for k, v in value.items():
        x = real(v, f"{k!r} ") if k != "score" else None
        if x is not None:
            extra[k] = x
    if len(extra) > MAX_EXTRAS:
        raise BadReturn(f"returned a dict of {len(extra)} real values besides 'score'; at most {MAX_EXTRAS} "
                        "are logged (reward/extra/<key>)")
    return {"score": score, "extra": extra}


def real(value: Any, what: str) -> float | None:
    """`value` as a float when it is a real number, None when it is not one; `BadReturn` (naming
    `what`) when it is one that is not finite or that no float holds."""
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # numpy and torch 0-d values
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, decimal.Decimal)):
        return None
    try:
        x = float(value)
    except OverflowError:
        raise BadReturn(f"returned {what}{_show(value)}, which overflows a float") from None
    if not math.isfinite(x):
        raise BadReturn(f"returned {what}{x}, which is not finite")
    return x


def _show(value: Any) -> str:
    """A value as a message repeats it: its repr and type, cut short (an int too long to print as
    digits by its size)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # the user's __repr__  # noqa: BLE001
        text = "?"
    return f"{shorten(text, 60)} ({type(value).__name__})"


REWARD = UserCodeKind("reward", reward_result)  # called as verl calls compute_score (rewards/custom.py)
