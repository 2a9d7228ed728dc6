"""The `flexfloor` command line.

Each subcommand lives in its own module with `register(subparsers)`; the module must import torch
and other heavy packages inside its run function, so `flexfloor plan --help` stays instant.
A `FlexFloorError` (bad config, trace, checkpoint, flag) prints one line and exits with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from megatron_rl.errors import FlexFloorError, Interrupted

# Order here is the order in `flexfloor --help`.
COMMANDS = [
    "megatron_rl.cli.demo",
    "megatron_rl.cli.rollout",
    "megatron_rl.cli.plan",
    "megatron_rl.cli.predict",
    "megatron_rl.cli.simulate",
    "megatron_rl.cli.train",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexfloor",
        description="Elastic expert-parallel rollouts for synchronous MoE RL post-training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FlexFloorError as e:
        print(f"flexfloor {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"flexfloor {args.command}: interrupted", file=sys.stderr)
        return 130
    except Interrupted as e:  # a signal ended the ranks; what they finished is in --out
        print(f"flexfloor {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
