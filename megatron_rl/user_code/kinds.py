"""A kind of user file: the config section that names one, and what a call of it must return.

A kind's `result` runs in the worker, on exactly what the user's function returned, and turns it
into plain data (JSON) for the run, or raises `BadReturn` saying what was wrong with it; a user
object (a tensor, a numpy scalar, a dict subclass) never leaves the worker. The kinds themselves
live beside their contracts (`reward_kind.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


class BadReturn(Exception):
    """A call's return value that its kind does not accept; the message says what it was."""


@dataclass(frozen=True)
class UserCodeKind:
    section: str  # the config section naming the file: `<section>.path`, `<section>.name`
    result: Callable[[Any], Any]  # in the worker: a call's return value -> plain data, or BadReturn
