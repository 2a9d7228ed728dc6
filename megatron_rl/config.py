"""Dataclass configs read from YAML, with every mistake reported as file + field + expectation.

Configs are plain dataclasses that validate themselves in `__post_init__`; YAML files and CLI flags
only override fields. `load_dataclass` checks unknown keys and types before the dataclass sees them,
so a typo in a YAML file names the file and the dotted field instead of failing deep inside a run.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml

from elastic.errors import shorten
from megatron_rl.errors import ConfigError
from megatron_rl.files.yaml_input import parse
from megatron_rl.provenance import provenance_comment

T = TypeVar("T")
INT_LIMIT = 2**63  # every integer field must fit a 64-bit signed integer (torch, numpy, C)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats, lists to tuples)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, tp, where)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(repr(a) for a in typing.get_args(tp))
            raise ConfigError(f"{where}: expected one of {choices}, got {shorten(repr(value))}")
        return value
    if dataclasses.is_dataclass(tp) or origin in (list, tuple, dict):
        return _coerce_nested(value, tp, where)
    if tp in _SCALARS:
        return _SCALARS[tp](value, where)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {shorten(repr(value))}")
    return value


def _coerce_union(value: Any, tp: Any, where: str) -> Any:
    """The first of a union's members `value` passes; else one error (a list of choices for Literals)."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(value, arg, where)
        except ConfigError:
            pass
    choices = [a for arg in args if typing.get_origin(arg) is typing.Literal for a in typing.get_args(arg)]
    if choices and len(choices) == sum(len(typing.get_args(a)) for a in args if a is not type(None)):
        nullable = " or null" if type(None) in args else ""
        raise ConfigError(f"{where}: expected one of {', '.join(repr(c) for c in choices)}{nullable}, "
                          f"got {shorten(repr(value))}")
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {shorten(repr(value))}")


def _coerce_nested(value: Any, tp: Any, where: str) -> Any:
    """A section (a dataclass read from a mapping), a list or tuple item by item, or a mapping."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {shorten(repr(value))}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {shorten(repr(value))}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {shorten(repr(value))}")
    return dict(value)


def _float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {shorten(repr(value))}")
    # No field means inf or nan: a timeout of .inf, a cost of nan, 1e400 (read as inf) are typos.
    if isinstance(value, int) and abs(value) >= INT_LIMIT or not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {shorten(repr(value), 40)}")
    return float(value)


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer, got {shorten(repr(value))}")
    if abs(value) >= INT_LIMIT:
        raise ConfigError(f"{where}: expected an integer of at most 2^63 - 1, got {shorten(repr(value), 40)}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {shorten(repr(value))}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {shorten(repr(value))}")
    return value


_SCALARS = {float: _float, int: _int, bool: _bool, str: _str}


def from_dict(cls: type[T], data: dict, where: str) -> T:
    """Build dataclass `cls` from `data`; `where` prefixes every error (e.g. 'cfg.yaml: model')."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    upgrade = getattr(cls, "upgrade", None)  # a config that renamed fields reads the old names too
    if upgrade is not None:
        data = upgrade(data)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown field {shorten(repr(unknown[0]), 80)} (known fields: {', '.join(sorted(fields))})"
        )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x} at file offset "
                          f"{e.start})") from None
    data = parse(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_dataclass(cls: type[T], path: str | Path | None, overrides: dict | None = None,
                   sources: dict[str, str] | None = None) -> T:
    """Read `cls` from a YAML file (or defaults when `path` is None), then apply `overrides`.

    Overrides are dotted keys (`{"rollout.max_batch": 8}`) as the CLI produces them; `sources` names
    where each came from (`{"ranks": "--ranks 0"}`). An error that the file alone does not have is
    blamed on the first override that brings it in, not on the file.
    """
    data = load_yaml(path) if path is not None else {}
    where = str(path) if path is not None else "config"
    overrides, sources = overrides or {}, sources or {}
    merged = _with(data, overrides, sources)
    try:
        return from_dict(cls, merged, where)
    except ConfigError as e:
        if not overrides:
            raise
        err = e
    # The error names an override's field: that one is to blame, whichever override made the
    # check run (`partial.end=budget partial.token_budget=0` is the budget's fault, not the end's).
    body = str(err)[len(where):].lstrip(".: ")
    named = [k for k in overrides if re.search(rf"(?<![\w.]){re.escape(k)}(?=[: ])", body)]
    if len(named) == 1:  # several named (`backend megatron ... ranks 12`): the one that brings it in, below
        raise ConfigError(f"{sources.get(named[0], f'{named[0]}={overrides[named[0]]}')}: {body}") from None
    items = list(overrides.items())
    for i in range(len(items) + 1):  # the file alone (i = 0), then one override more at a time
        partial = _with(data, dict(items[:i]), sources)
        try:
            from_dict(cls, partial, where)
        except ConfigError as e:
            if i == 0:
                raise
            key = items[i - 1][0]
            label = sources.get(key, f"{key}={items[i - 1][1]}")
            raise ConfigError(f"{label}: {str(e)[len(where):].lstrip('.: ')}") from None
    raise err


def _with(data: dict, overrides: dict, sources: dict[str, str]) -> dict:
    """A copy of `data` with the dotted `overrides` set."""
    import copy

    data = copy.deepcopy(data)
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for i, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                section = ".".join(parents[: i + 1])
                raise ConfigError(f"{sources.get(key, key)}: {section} is a value, not a section")
        node[leaf] = value
    return data


def require(cond: bool, message: str) -> None:
    """Validation helper for `__post_init__`: raise a ConfigError naming what was expected."""
    if not cond:
        raise ConfigError(message)


SEED_LIMIT = 2**32  # seeds are mixed into 64-bit generator seeds (e.g. seed x 1_000_003 + step)


def require_seed(seed: int, name: str = "seed") -> None:
    require(0 <= seed < SEED_LIMIT, f"{name}: expected an integer in [0, 2^32), got {shorten(repr(seed), 40)}")


MAX_SIZE = 2**24  # any one model dimension, batch or token count: beyond it a value is a typo


def require_size(value: int, name: str, low: int = 1) -> None:
    """A count that sizes an allocation (a model dimension, batch slots, prompts): in [low, 2^24]."""
    require(low <= value <= MAX_SIZE, f"{name}: expected an integer in [{low}, 2^24], got {shorten(repr(value), 40)}")


# One rollout's responses: every rank keeps each one's tokens and log-probs and the planner lays out
# a row per response, so this bounds a rollout's host memory per rank (about a GiB at 2^20 responses
# of a few hundred tokens). The 30B example launches 128 prompts x 16 = 2048.
MAX_ROLLOUT_RESPONSES = 2**20


def require_rollout_size(groups: int, group_size: int, what: str) -> None:
    """`groups` GRPO groups of `group_size` responses in one rollout (`what` says how many groups)."""
    require(groups * group_size <= MAX_ROLLOUT_RESPONSES,
            f"{what} x grpo.group_size {group_size} = {groups * group_size:.4g} responses per rollout, "
            "above the limit of 2^20 (every rank holds each response's tokens and log-probs)")


WEEK_S = 7 * 24 * 3600.0  # the longest duration any field may hold (timers overflow far beyond it)


def require_seconds(value: float, name: str, low: float = 0.0) -> None:
    """A duration: more than `low` (or, for a collective's timeout, at least 1 s) and at most a week."""
    require(low < value <= WEEK_S, f"{name}: expected seconds in ({low:g}, {WEEK_S:g}], got {value:g}")


def require_timeout(value: float, name: str = "timeout_s") -> None:
    """A collective's timeout: at least 1 s (a rendezvous takes that long), at most a week."""
    require(1.0 <= value <= WEEK_S, f"{name}: expected seconds in [1, {WEEK_S:g}], got {value:g}")


def parse_time(value: str, where: str) -> float:
    """Unix seconds from an ISO 8601 time (no zone: local time) or a number of Unix seconds."""
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ConfigError(f"{where}: expected an ISO 8601 time (2026-12-01T23:00:00Z) or Unix seconds, "
                          f"got {shorten(repr(value))}") from None


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def config_yaml(cfg) -> str:
    return yaml.safe_dump(_plain(dataclasses.asdict(cfg)), sort_keys=False)


def write_config(cfg, out_dir: str | Path) -> None:
    """Record the resolved config as `out_dir/config.yaml` (a rerun can pass it as --config), after
    a comment line with the run's provenance (git sha, versions, image)."""
    (Path(out_dir) / "config.yaml").write_text(provenance_comment() + config_yaml(cfg), encoding="utf-8")
