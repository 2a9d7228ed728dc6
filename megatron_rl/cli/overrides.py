"""Config overrides the way RL users type them, and the resolved config printed or recorded.

    flexfloor train --config c.yaml grpo.group_size=16 optim.lr=1e-6 --print-config

Any field of the command's config dataclass can be set as `dotted.key=value` after the command
(Hydra/verl style); the value is read as YAML (`true`, `null`, `[1, 2]`, `1e-6`). Flags and
`key=value` go through the same dataclasses, so a bad key, value or type stops with the same one-line
error, naming the override (or flag) that brought it in. `--print-config` prints the resolved config
as YAML (`megatron_rl.config.config_yaml`) and exits.
"""
from __future__ import annotations

import os
import re

from megatron_rl.errors import ConfigError

_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def add_override_args(p) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="set any config field, e.g. grpo.group_size=16 optim.lr=1e-6 (dotted field "
                        "name, YAML value; applied after the file and the flags)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit")


def parse_overrides(tokens: list[str]) -> tuple[dict, dict[str, str]]:
    """`["a.b=1", ...]` -> ({"a.b": 1}, {"a.b": "a.b=1"}) (values, and where each came from)."""
    from elastic.errors import shorten
    from megatron_rl.files.yaml_input import parse

    values, sources = {}, {}
    for tok in tokens:
        key, eq, text = tok.partition("=")
        if not eq or not _KEY.fullmatch(key):
            raise ConfigError(f"{shorten(repr(tok))}: expected KEY=VALUE with a dotted field name, e.g. "
                              "grpo.group_size=16")
        label = tok if len(tok) <= 200 else f"{key}=..."
        values[key], sources[key] = parse(text, label, value=True) if text.strip() else None, label
    return values, sources


def flag_overrides(args, table) -> tuple[dict, dict[str, str]]:
    """The flags of `table` ((attribute, config key), ...) that were given, with their spelling."""
    values, sources = {}, {}
    for attr, key in table:
        v = getattr(args, attr, None)
        if v is None:
            continue
        flag = "--" + attr.replace("_", "-")
        values[key], sources[key] = v, flag if v is True else f"{flag} {v}"
    return values, sources


# The commands that take a config file, and their configs' classes (module, name), so a file given
# to the wrong one is named as the other's.
CONFIG_COMMANDS = {"flexfloor rollout": ("megatron_rl.rollout.config", "RolloutConfig"),
                   "flexfloor train": ("megatron_rl.trainer_config", "TrainerConfig")}


def resolve(cls, path, args, table, world_size_key: str | None = None, extra: dict | None = None):
    """The command's config: file (or defaults), then the flags of `table` and `extra`
    ({key: (value, label)}), then `key=value`. Under torchrun, `world_size_key` is WORLD_SIZE."""
    from megatron_rl.config import load_dataclass
    from megatron_rl.errors import ConfigError

    values, sources = flag_overrides(args, table)
    for key, (value, label) in (extra or {}).items():
        values[key], sources[key] = value, label
    if world_size_key and _under_torchrun():
        values[world_size_key] = int(os.environ["WORLD_SIZE"])
        sources[world_size_key] = f"WORLD_SIZE={os.environ['WORLD_SIZE']} (torchrun)"
    kv, kv_sources = parse_overrides(getattr(args, "overrides", None) or [])
    values.update(kv)
    sources.update(kv_sources)
    try:
        return load_dataclass(cls, path, values, sources)
    except ConfigError as e:
        raise ConfigError(f"{e}{_other_command(cls, path)}") from None


def _other_command(cls, path) -> str:
    """A hint when `path`'s top-level fields are another command's config and not `cls`'s."""
    import dataclasses
    import importlib

    from megatron_rl.config import load_yaml
    from megatron_rl.errors import ConfigError

    if path is None:
        return ""
    try:
        keys = set(load_yaml(path))
    except ConfigError:
        return ""
    if not keys or keys <= {f.name for f in dataclasses.fields(cls)}:
        return ""
    for command, (module, name) in CONFIG_COMMANDS.items():
        other = getattr(importlib.import_module(module), name)
        if other is not cls and keys <= {f.name for f in dataclasses.fields(other)}:
            return f"; {path} is a `{command}` config ({name})"
    return ""


def _under_torchrun() -> bool:
    from megatron_rl.parallel.launch import under_torchrun  # imports torch: only where ranks run

    return under_torchrun()
