"""A command's config: the file (or the defaults), then its flags, then `key=value` overrides
(`megatron_rl/cli/overrides.py` reads them), through the same dataclasses; under torchrun the world
size is WORLD_SIZE's. A file given to the wrong command is named as the other command's config."""
from __future__ import annotations

import dataclasses
import os

from megatron_rl.cli.overrides import flag_overrides, parse_overrides
from megatron_rl.config import load_dataclass, load_yaml
from megatron_rl.errors import ConfigError
from megatron_rl.parallel.torchrun import under_torchrun
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.trainer_config import TrainerConfig

# The commands that take a config file, and their configs' classes, so a file given to the wrong one
# is named as the other's.
CONFIG_COMMANDS = {"flexfloor rollout": RolloutConfig, "flexfloor train": TrainerConfig}


def resolve(cls, path, args, table, world_size_key: str | None = None, extra: dict | None = None):
    """The command's config: file (or defaults), then the flags of `table` and `extra`
    ({key: (value, label)}), then `key=value`. Under torchrun, `world_size_key` is WORLD_SIZE."""
    values, sources = flag_overrides(args, table)
    for key, (value, label) in (extra or {}).items():
        values[key], sources[key] = value, label
    if world_size_key and under_torchrun():
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
    if path is None:
        return ""
    try:
        keys = set(load_yaml(path))
    except ConfigError:
        return ""
    if not keys or keys <= {f.name for f in dataclasses.fields(cls)}:
        return ""
    for command, other in CONFIG_COMMANDS.items():
        if other is not cls and keys <= {f.name for f in dataclasses.fields(other)}:
            return f"; {path} is a `{command}` config ({other.__name__})"
    return ""
