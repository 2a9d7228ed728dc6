"""`flexfloor rollout`: one rollout on W ranks (spawned here, or joined under torchrun).

Devices: `device: cpu` runs gloo ranks; `device: cuda` runs one rank per GPU (cuda:LOCAL_RANK)
over NCCL, e.g. 8 ranks per node on 8-GPU nodes (examples/slurm/ starts them and passes
`--device cuda`); `auto` picks cuda when CUDA is available. `device: cuda` on a machine without CUDA
stops with one line (exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from elastic.ledger import format_report
from elastic.planning.policies import POLICIES, policy_kind
from elastic.timeline import Timeline
from elastic.timeline_plot import plot_timelines
from megatron_rl.cli.outputs import check_out_dir, check_out_file, check_plot_dir
from megatron_rl.cli.overrides import add_override_args, resolve
from megatron_rl.config import config_yaml, write_config
from megatron_rl.files.out_lock import hold_out_dir
from megatron_rl.metrics.wandb_run import LoggingConfig, log_report, policy_tags


def add_rollout_args(p: argparse.ArgumentParser, default_config: str | None, policy: bool = True) -> None:
    p.add_argument("--config", default=default_config,
                   help="YAML rollout config (default: the built-in tiny CPU example)")
    p.add_argument("--trace", help="length trace (JSON Lines) to replay instead of the synthetic batch")
    p.add_argument("--epoch", type=int, help="trace epoch to replay (default: the last)")
    p.add_argument("--length-scale", type=float, help="multiply traced lengths by this (CPU runs)")
    p.add_argument("--ranks", type=int, help="number of ranks (ignored under torchrun: WORLD_SIZE)")
    if policy:  # `demo` runs a fixed pair of policies
        p.add_argument("--policy", choices=POLICIES)
    p.add_argument("--floor", type=int, help="fewest ranks the EP group may shrink to")
    p.add_argument("--tailguard", action="store_true", default=None, help="guard predictions with TailGuard")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="cpu: gloo ranks; cuda: one GPU per rank over NCCL; auto: cuda when available")
    p.add_argument("--sample", action="store_true", help="seeded temperature/top-p sampling instead of greedy")
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


def resolve_rollout(args, pinned: dict | None = None):
    """The rollout config: file, flags, `key=value` overrides; `pinned` ({key: (value, label)}) is
    what a command fixes (demo's two policies)."""
    from megatron_rl.rollout.config import RolloutConfig  # torch: not on `--help`'s path

    extra = {"sampling.greedy": (False, "--sample")} if getattr(args, "sample", False) else {}
    extra.update(pinned or {})
    return resolve(RolloutConfig, args.config, args, FLAGS, world_size_key="ranks", extra=extra)


def run(args) -> int:
    cfg = resolve_rollout(args)
    if args.print_config:
        print(config_yaml(cfg), end="")
        return 0
    out_dir = args.out
    check_out_dir(out_dir, "--out")
    check_out_file(args.json, "--json")
    check_plot_dir(args.plot)
    with hold_out_dir(out_dir, "rollout"):
        return _rollout(args, cfg, out_dir)


def _rollout(args, cfg, out_dir) -> int:
    from megatron_rl.rollout_runner import run_rollout  # torch: not on `--help`'s path

    if out_dir is not None:
        write_config(cfg, out_dir)
    t0 = time.perf_counter()
    result = run_rollout(cfg, out_dir, quiet=args.quiet)
    if result is None:  # a non-zero rank under torchrun
        return 0
    report, responses = result
    print(format_report(report))
    for rank, freed in sorted(report["freed_bytes"].items(), key=lambda kv: int(kv[0])):
        print(f"detached rank {rank} freed {sum(freed.values()) / 2**20:.2f} MiB for leases "
              f"(KV cache {freed['kv_cache'] / 2**20:.2f} MiB, experts {freed['experts'] / 2**20:.2f} MiB)")
    if len(report["stages"]) > 1:
        print(f"policy {report['policy']}, floor {report['floor']}: stages "
              f"{' -> '.join(str(len(s)) for s in report['stages'])} ranks, reached stage "
              f"{report['final_stage']}; shrink latency per stage (s): {report['shrink_latency_s']}")
    if report.get("migrated"):
        print(f"{report['migrated']} live requests moved with their KV cache (online rule)")
    if report["kv"]["cache"] == "paged":
        kv = report["kv"]
        print(f"paged KV cache: prefill computed {kv['prefill_tokens_computed']} of {kv['prefill_tokens_requested']} "
              f"tokens (group prefix sharing), {kv['pages_shared']} pages shared, {kv['preemptions']} preemptions")
    if report.get("partial"):
        p = report["partial"]
        print(f"partial rollout ({p['rule']}): ended with {p['groups_complete']} of {p['groups']} groups "
              f"complete (target {p['target_groups']}); {p['carried']} responses would carry over "
              f"({p['carried_tokens']} tokens so far)")
    print(f"responses_sha256 {report['responses_sha256']} ({report['responses']} responses, "
          f"{time.perf_counter() - t0:.1f}s total)")
    if out_dir is not None:
        with open(Path(out_dir) / "responses.jsonl", "w", encoding="utf-8") as fh:
            for r in sorted(responses, key=lambda r: (r["prompt_id"], r["sample"])):
                fh.write(json.dumps(r) + "\n")
        (Path(out_dir) / "report.json").write_text(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    plot = write_timeline(report, Path(args.plot) / "timeline.png", rollout_title(report)) if args.plot else None
    if args.wandb:
        log_rollout_wandb(args, cfg, report, plot)
    sys.stdout.flush()
    return 0


def rollout_title(report: dict) -> str:
    """A timeline's title: the policy, and the floor and TailGuard of a shrinking one."""
    if len(report["stages"]) == 1 and not policy_kind(report["policy"]).uses_planner:
        return report["policy"]
    return f"{report['policy']} floor {report['floor']}" + (" + TailGuard" if report["tailguard"] else "")


def write_timeline(report: dict, path: Path, title: str) -> Path:
    """The rollout's per-rank timeline as a PNG (elastic/timeline_plot.py); says where on stderr."""
    out = plot_timelines([Timeline.of_report(report, title)], path)
    print(f"wrote {out}", file=sys.stderr)
    return out


def log_rollout_wandb(args, cfg, report: dict, plot: Path | None = None) -> None:
    """The report as one offline (unless WANDB_MODE=online) W&B run under --out (or `.`): its
    numbers, the timeline's segments as a table, and the timeline figure when --plot drew one."""
    from megatron_rl.metrics.keys import grouped, numeric  # numpy: not on `--help`'s path

    logging = LoggingConfig(project=args.wandb, experiment=Path(args.config).stem if args.config else "rollout")
    metrics = numeric(grouped({k: v for k, v in report.items() if k != "per_rank"}))
    timeline = Timeline.of_report(report)
    folder = log_report(args.out or ".", logging, job_type="rollout", config=asdict(cfg),
                        tags=policy_tags(report["policy"], report["floor"]), metrics=metrics,
                        tables={"timeline": (timeline.columns(), timeline.rows())},
                        images=[plot] if plot is not None else None)
    if folder is not None:
        print(f"wandb: {folder}", file=sys.stderr)


def register(sub) -> None:
    p = sub.add_parser("rollout", help="run one rollout on CPU or GPU ranks and print the rank-time ledger",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rollout_args(p, default_config=None)
    p.add_argument("--wandb", nargs="?", const="flexfloor", metavar="PROJECT",
                   help="log the report to W&B project PROJECT (default flexfloor), offline under --out "
                        "(or .) unless WANDB_MODE=online")
    p.set_defaults(func=run)
