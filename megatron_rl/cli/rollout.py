"""`flexfloor rollout`: one rollout on W CPU ranks (spawned here, or joined under torchrun)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_rollout_args(p: argparse.ArgumentParser, default_config: str | None, policy: bool = True) -> None:
    p.add_argument("--config", default=default_config,
                   help="YAML rollout config (default: the built-in tiny CPU example)")
    p.add_argument("--trace", help="length trace (JSON Lines) to replay instead of the synthetic batch")
    p.add_argument("--epoch", type=int, help="trace epoch to replay (default: the last)")
    p.add_argument("--length-scale", type=float, help="multiply traced lengths by this (CPU runs)")
    p.add_argument("--ranks", type=int, help="number of ranks (ignored under torchrun: WORLD_SIZE)")
    if policy:  # `demo` runs a fixed pair of policies
        p.add_argument("--policy", choices=["vanilla", "lengthsort", "natural", "planned", "adaptive"])
    p.add_argument("--floor", type=int, help="fewest ranks the EP group may shrink to")
    p.add_argument("--tailguard", action="store_true", default=None, help="guard predictions with TailGuard")
    p.add_argument("--seed", type=int)
    p.add_argument("--sample", action="store_true", help="seeded temperature/top-p sampling instead of greedy")
    p.add_argument("--out", help="folder for plan.json, streamed responses and report.json")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON to this file")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def overrides_from_args(args) -> dict:
    import os

    from megatron_rl.parallel.launch import under_torchrun

    o = {}
    for flag, key in (("trace", "batch.trace"), ("epoch", "batch.epoch"),
                      ("length_scale", "batch.length_scale"), ("ranks", "ranks"), ("policy", "policy"),
                      ("floor", "floor"), ("tailguard", "tailguard"), ("seed", "seed")):
        v = getattr(args, flag, None)
        if v is not None:
            o[key] = v
    if getattr(args, "sample", False):
        o["sampling.greedy"] = False
    if under_torchrun():
        o["ranks"] = int(os.environ["WORLD_SIZE"])
    return o


def run(args) -> int:
    from elastic.ledger import format_report
    from megatron_rl.config import load_dataclass
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.runner import run_rollout

    cfg = load_dataclass(RolloutConfig, args.config, overrides_from_args(args))
    out_dir = args.out
    t0 = time.perf_counter()
    result = run_rollout(cfg, out_dir, quiet=args.quiet)
    if result is None:  # a non-zero rank under torchrun
        return 0
    report, responses = result
    print(format_report(report))
    if len(report["stages"]) > 1:
        print(f"policy {report['policy']}, floor {report['floor']}: stages "
              f"{' -> '.join(str(len(s)) for s in report['stages'])} ranks, reached stage "
              f"{report['final_stage']}; shrink latency per stage (s): {report['shrink_latency_s']}")
    if report.get("migrated"):
        print(f"{report['migrated']} live requests moved with their KV cache (online rule)")
    print(f"responses_sha256 {report['responses_sha256']} ({report['responses']} responses, "
          f"{time.perf_counter() - t0:.1f}s total)")
    if out_dir is not None:
        with open(Path(out_dir) / "responses.jsonl", "w", encoding="utf-8") as fh:
            for r in sorted(responses, key=lambda r: (r["prompt_id"], r["sample"])):
                fh.write(json.dumps(r) + "\n")
        (Path(out_dir) / "report.json").write_text(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    sys.stdout.flush()
    return 0


def register(sub) -> None:
    p = sub.add_parser("rollout", help="run one rollout on CPU ranks and print the rank-time ledger",
                       description=__doc__)
    add_rollout_args(p, default_config=None)
    p.set_defaults(func=run)
