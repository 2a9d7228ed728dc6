"""Config overrides the way RL users type them, and the resolved config printed or recorded.

    flexfloor train --config c.yaml grpo.group_size=16 optim.lr=1e-6 --print-config

Any field of the command's config dataclass can be set as `dotted.key=value` after the command
(Hydra/verl style); the value is read as YAML (`true`, `null`, `[1, 2]`, `1e-6`). Flags and
`key=value` go through the same dataclasses, so a bad key, value or type stops with the same one-line
error, naming the override (or flag) that brought it in. `--print-config` prints the resolved config
as YAML (`megatron_rl.config.config_yaml`) and exits. A command resolves its config from these
(`megatron_rl/commands/resolve.py`).
"""
from __future__ import annotations

import re

from elastic.errors import shorten
from megatron_rl.errors import ConfigError
from megatron_rl.files.yaml_input import parse

_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def add_override_args(p) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="set any config field, e.g. grpo.group_size=16 optim.lr=1e-6 (dotted field "
                        "name, YAML value; applied after the file and the flags)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit")


def parse_overrides(tokens: list[str]) -> tuple[dict, dict[str, str]]:
    """`["a.b=1", ...]` -> ({"a.b": 1}, {"a.b": "a.b=1"}) (values, and where each came from)."""
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
