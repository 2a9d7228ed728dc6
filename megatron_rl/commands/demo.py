"""`flexfloor demo` (its flags: megatron_rl/cli/demo.py): vanilla, then planned residency with floor 1
and TailGuard, on the same batch in one world of ranks; both ledgers, the dummy run removed, and
whether the responses are identical."""
from __future__ import annotations

import json
import time
from pathlib import Path

from elastic.ledger import format_report
from elastic.timeline import Timeline
from elastic.timeline_plot import plot_timelines
from megatron_rl.commands.outputs import check_out_file, check_plot_dir
from megatron_rl.commands.rollout import resolve_rollout, rollout_title
from megatron_rl.config import config_yaml
from megatron_rl.parallel.torchrun import driver_process
from megatron_rl.rollout_runner import run_rollouts


def run(args) -> int:
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
    van, flex = (r.report for r in results)
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
