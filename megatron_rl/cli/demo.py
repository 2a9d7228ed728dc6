"""`flexfloor demo`: the built-in example, vanilla against FlexFloor on 4 CPU ranks.

A tiny Qwen3-MoE (2 layers, 8 experts) replays a DeepScaleR-like length-tailed batch twice in one
gloo world: `vanilla` (verl-style: nobody leaves the EP group) and `planned` residency with floor 1
and TailGuard. It prints both rank-time ledgers, the dummy run removed, and checks that both produced
identical responses; `--json OUT` writes both reports (`{"vanilla": ..., "planned": ...}`, each as
`flexfloor rollout --json` writes its one), `--plot DIR` draws both rollouts' per-rank timelines.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from elastic.ledger import format_report
from elastic.timeline import Timeline
from elastic.timeline_plot import plot_timelines
from megatron_rl.cli.outputs import check_out_file, check_plot_dir
from megatron_rl.cli.rollout import add_rollout_args, resolve_rollout, rollout_title
from megatron_rl.config import config_yaml


def run(args) -> int:
    # torch: not on `--help`'s path
    from megatron_rl.parallel.launch import driver_process
    from megatron_rl.rollout_runner import run_rollouts

    elastic = {"policy": "planned", "floor": args.floor or 1, "tailguard": True}
    cfgs = [resolve_rollout(args, {"policy": ("vanilla", "demo's first run")}),
            resolve_rollout(args, {k: (v, "demo's second run") for k, v in elastic.items()})]
    if args.print_config:
        print("\n---\n".join(config_yaml(c) for c in cfgs), end="")
        return 0
    check_out_file(args.json, "--json")
    check_plot_dir(args.plot)
    if driver_process():
        print(f"FlexFloor demo: a {cfgs[0].model.num_layers}-layer, {cfgs[0].model.num_moe_experts}-expert "
              f"Qwen3-MoE on {cfgs[0].ranks} gloo ranks replays a length-tailed batch twice: vanilla, then "
              f"planned residency (floor {elastic['floor']}, TailGuard).", flush=True)
    t0 = time.perf_counter()
    results = run_rollouts(cfgs, quiet=args.quiet)
    if results is None:  # a non-zero rank under torchrun
        return 0
    (van, _), (flex, _) = results
    for title, rep in (("vanilla", van), (f"planned floor {flex['floor']} + TailGuard", flex)):
        print(f"\n== {title}")
        print(format_report(rep))
    dv, df = van["rank_seconds"]["dummy"], flex["rank_seconds"]["dummy"]
    print(f"\nEP group: {' -> '.join(str(len(s)) for s in flex['stages'][:flex['final_stage'] + 1])} ranks; "
          f"shrink latency per stage (ms): "
          + ", ".join(f"{1000 * v:.1f}" for v in flex["shrink_latency_s"].values()))
    print(f"dummy run {dv:.2f} -> {df:.2f} rank-s ({1 - df / dv:.0%} removed); rollout time "
          f"{van['rollout_time_s']:.2f} -> {flex['rollout_time_s']:.2f} s; response tokens per occupied "
          f"rank-second x{flex['tokens_per_occupied_rank_s'] / van['tokens_per_occupied_rank_s']:.2f}; "
          f"{flex['detached_rank_s']:.2f} detached rank-s freed for leases")
    if args.json:
        Path(args.json).write_text(json.dumps({"vanilla": van, "planned": flex}, indent=2))
    if args.plot:
        write_demo_timelines(van, flex, args.plot)
    same = van["responses_sha256"] == flex["responses_sha256"]
    print(f"identical responses: {same} (sha256 {van['responses_sha256'][:16]}...); "
          f"{time.perf_counter() - t0:.1f}s total")
    return 0 if same else 1


def write_demo_timelines(van: dict, flex: dict, folder: str) -> None:
    """Both rollouts' per-rank timelines, each alone and side by side on one time axis."""
    pair = [Timeline.of_report(rep, rollout_title(rep)) for rep in (van, flex)]
    for path in (plot_timelines([pair[0]], Path(folder) / "timeline-vanilla.png"),
                 plot_timelines([pair[1]], Path(folder) / f"timeline-{flex['policy']}.png"),
                 plot_timelines(pair, Path(folder) / "timeline-demo.png")):
        print(f"wrote {path}")


def register(sub) -> None:
    p = sub.add_parser("demo", help="the built-in example: vanilla vs FlexFloor on 4 CPU ranks",
                       description=__doc__)
    add_rollout_args(p, default_config=None, policy=False)
    p.set_defaults(func=run)
