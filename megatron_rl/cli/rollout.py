"""`flexfloor rollout`: one rollout on W ranks (spawned here, or joined under torchrun).

Devices: `device: cpu` runs gloo ranks; `device: cuda` runs one rank per GPU (cuda:LOCAL_RANK)
over NCCL, e.g. 8 ranks per node on 8-GPU nodes (examples/slurm/ starts them and passes
`--device cuda`); `auto` picks cuda when CUDA is available. `device: cuda` on a machine without CUDA
stops with one line (exit 2).
"""
from __future__ import annotations

import argparse

from elastic.planning.policies import POLICIES
from megatron_rl.cli.overrides import add_override_args


def add_rollout_args(p: argparse.ArgumentParser, default_config: str | None, one_run: bool = True) -> None:
    """`one_run`: the flags of a single rollout, its `--policy` and its `--out` folder; `demo` runs a
    fixed pair of policies and writes only `--json` and `--plot`."""
    p.add_argument("--config", default=default_config,
                   help="YAML rollout config (default: the built-in tiny CPU example)")
    p.add_argument("--trace", help="length trace (JSON Lines) to replay instead of the synthetic batch")
    p.add_argument("--epoch", type=int, help="trace epoch to replay (default: the last)")
    p.add_argument("--length-scale", type=float, help="multiply traced lengths by this (CPU runs)")
    p.add_argument("--ranks", type=int, help="number of ranks (ignored under torchrun: WORLD_SIZE)")
    if one_run:
        p.add_argument("--policy", choices=POLICIES)
    p.add_argument("--floor", type=int, help="fewest ranks the EP group may shrink to")
    p.add_argument("--tailguard", action="store_true", default=None, help="guard predictions with TailGuard")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="cpu: gloo ranks; cuda: one GPU per rank over NCCL; auto: cuda when available")
    p.add_argument("--sample", action="store_true", help="seeded temperature/top-p sampling instead of greedy")
    if one_run:
        p.add_argument("--out", help="folder for plan.json, streamed responses and report.json")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON to this file")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--plot", metavar="DIR",
                   help="write each rollout's per-rank timeline (states over wall time, stage changes, "
                        "migrations and leases marked) as a PNG to DIR (needs matplotlib)")
    add_override_args(p)


FLAGS = (("trace", "batch.trace"), ("epoch", "batch.epoch"), ("length_scale", "batch.length_scale"),
         ("ranks", "ranks"), ("policy", "policy"), ("floor", "floor"), ("tailguard", "tailguard"),
         ("seed", "seed"), ("device", "device"))


def register(sub) -> None:
    p = sub.add_parser("rollout", help="run one rollout on CPU or GPU ranks and print the rank-time ledger",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rollout_args(p, default_config=None)
    p.add_argument("--wandb", nargs="?", const="flexfloor", metavar="PROJECT",
                   help="log the report to W&B project PROJECT (default flexfloor), offline under --out "
                        "(or .) unless WANDB_MODE=online")
