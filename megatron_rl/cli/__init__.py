"""The `flexfloor` command line.

Each command's flags live in a module here with `register(subparsers)`, which imports nothing heavy;
what the command does is `run(args)` of its module in `megatron_rl/commands/`, imported only once the
command is parsed (it imports torch or numpy at its top), so `flexfloor plan --help` stays instant.
An `InputError` (elastic/errors.py: a bad config, trace, checkpoint, flag) is caught here, once: it
prints one line and exits with status 2. A full disk (an OSError of parallel/disk_full.py's `FULL`,
met here or on a rank, which the launcher raises as `DiskFull`) is one line too, exit status 1.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from elastic.errors import InputError, shorten
from megatron_rl.errors import Interrupted
from megatron_rl.parallel.disk_full import FULL, disk_full

# Order here is the order in `flexfloor --help`.
COMMANDS = [
    "megatron_rl.cli.demo",
    "megatron_rl.cli.rollout",
    "megatron_rl.cli.plan",
    "megatron_rl.cli.predict",
    "megatron_rl.cli.simulate",
    "megatron_rl.cli.train",
    "megatron_rl.cli.export",
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


MAX_MESSAGE = 2000  # characters of one error line (values in it are shortened where they are made)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parse_args`, except that `key=value` overrides may also come after flags
    (`train --config c.yaml --steps 3 optim.lr=1e-4`), where argparse would call them unrecognized."""
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    rest = [a for a in extra if a not in overrides]
    if rest or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {shorten(' '.join(rest or overrides))}")
    if overrides:
        args.overrides = [*(args.overrides or []), *overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    # The one deferred import of the command line: the command's run module, with torch or numpy.
    command = importlib.import_module(f"megatron_rl.commands.{args.command}")
    try:
        return int(command.run(args) or 0)
    except InputError as e:
        text = str(e).replace("\n", " ")
        print(f"flexfloor {args.command}: error: {shorten(text, MAX_MESSAGE)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `flexfloor demo | head -1`: the reader is gone, nothing to report to
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 128 + 13  # as a process that SIGPIPE ended
    except OSError as e:  # after BrokenPipeError, one of its kind
        if e.errno not in FULL:
            raise
        print(f"flexfloor {args.command}: error: {disk_full(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"flexfloor {args.command}: interrupted", file=sys.stderr)
        return 130
    except Interrupted as e:  # a signal ended the ranks; what they finished is in --out
        print(f"flexfloor {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
