"""A mistake in what the user gave (a config, a trace, a checkpoint, a flag), and how a message
repeats a value.

`InputError` is the one root of every such error, in both packages: `elastic/` raises its kinds
(`TraceError`, `PlanError`, `LayoutError`), `megatron_rl/errors.py` its own, and the CLI
(`megatron_rl/cli/__init__.py`) catches the root once: it prints the message alone and exits 2.
It lives on the lowest floor so that `elastic/` needs nothing from `megatron_rl/`. Bugs stay
ordinary exceptions, so their tracebacks reach us.
"""
from __future__ import annotations

MAX_SHOWN = 200  # characters of a value an error message may repeat


class InputError(Exception):
    """An error in user input; the message says where (file, field, flag, line) and what was expected."""


def shorten(value, limit: int = MAX_SHOWN) -> str:
    """What a message repeats of `value`, cut to `limit` characters (the cut says how many more there
    were): a text as it stands, an exception's first line (its type when it has no message), anything
    else's repr. Pass `repr(text)` where the reader must see that a value is a string."""
    if isinstance(value, BaseException):
        text = (str(value).strip().splitlines() or [type(value).__name__])[0]
    else:
        text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = text[:limit] + f"... ({len(text) - limit} more characters)"
    return text
