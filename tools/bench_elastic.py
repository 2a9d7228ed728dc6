"""Vanilla against FlexFloor policies, side by side on the same trace replay, 4 CPU ranks, one world.

Every configuration runs `--reps` times, interleaved (A B C A B C ...) so machine drift hits all
alike; the table shows medians. Ratios are against vanilla measured in the same run. The sidecar
line compares the best elastic configuration with and without side work on its detached ranks.

The sidecar serves held-out arithmetic queries with the model `tools/make_sidecar_model.py`
trains (built into --sidecar-model on first use, about 10 minutes on 2 cores), and the bench prints
the queries it served, their accuracy (each query counted once), restarts after pre-emption, and
the primary rollout's slowdown against the same configuration without side work.

On this machine all ranks share the same few CPU cores, so side work on a detached rank competes
with the resident ranks for cores; on a GPU cluster each rank has its own accelerator. The sidecar
slowdown printed here is therefore an upper bound of what a cluster would see.

    python tools/bench_elastic.py [--trace FILE] [--reps 2] [--length-scale 0.02] [--json OUT]
                                  [--sidecar-model runs/sidecar_arith]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", help="length trace to replay (default: synthetic DeepScaleR-like)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--length-scale", type=float, default=0.02)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", help="write all measurements here")
    ap.add_argument("--sidecar-model", default="runs/sidecar_arith",
                    help="tools/make_sidecar_model.py's output folder (made here if missing)")
    args = ap.parse_args(argv)
    sidecar = sidecar_inputs(args.sidecar_model)

    from megatron_rl.config import load_dataclass
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout_runner import run_rollouts

    base = {"batch.prompts": args.prompts, "batch.samples": args.samples,
            "batch.length_scale": args.length_scale, "ranks": 4}
    if args.trace:
        base["batch.trace"] = args.trace
    variants = {
        "vanilla": {"policy": "vanilla"},
        "lengthsort+tg": {"policy": "lengthsort", "tailguard": True},
        "natural-f1+tg": {"policy": "natural", "floor": 1, "tailguard": True},
        "planned-f2+tg": {"policy": "planned", "floor": 2, "tailguard": True},
        "planned-f1+tg": {"policy": "planned", "floor": 1, "tailguard": True},
        "adaptive-f1+tg": {"policy": "adaptive", "floor": 1, "tailguard": True},
        "natural-f1+tg+sidecar": {"policy": "natural", "floor": 1, "tailguard": True,
                                  "leases": ["rewards", "sidecar"], **sidecar},
    }
    names = [n for _ in range(args.reps) for n in variants]
    cfgs = [load_dataclass(RolloutConfig, None, {**base, **variants[n]}) for n in names]
    print(f"bench_elastic: {len(cfgs)} rollouts on 4 ranks ({args.reps} reps, interleaved)...",
          file=sys.stderr, flush=True)
    results = run_rollouts(cfgs, quiet=True)
    runs: dict[str, list[dict]] = {}
    for n, report in zip(names, (r.report for r in results)):
        runs.setdefault(n, []).append(report)

    def med(n, f):
        return statistics.median(f(r) for r in runs[n])

    shas = {r["responses_sha256"] for rs in runs.values() for r in rs}
    v_dummy = med("vanilla", lambda r: r["rank_seconds"]["dummy"])
    v_time = med("vanilla", lambda r: r["rollout_time_s"])
    v_tok = med("vanilla", lambda r: r["tokens_per_occupied_rank_s"])
    print(f"{'policy':<24}{'T (s)':>8}{'T/van':>8}{'dummy rank-s':>14}{'dummy cut':>11}"
          f"{'tok/occ rank-s':>16}{'x van':>7}{'detached rank-s':>17}{'dummy steps':>12}{'migrated':>9}"
          "  shrink latency (ms)")
    for n in variants:
        t = med(n, lambda r: r["rollout_time_s"])
        d = med(n, lambda r: r["rank_seconds"]["dummy"])
        tok = med(n, lambda r: r["tokens_per_occupied_rank_s"])
        det = med(n, lambda r: r["detached_rank_s"])
        steps = med(n, lambda r: r["rank_steps"]["dummy"])
        moved = sum(r.get("migrated", 0) for r in runs[n])
        lat = runs[n][-1]["shrink_latency_s"]
        lat_s = ", ".join(f"stage {k}: {1000 * v:.1f}" for k, v in lat.items()) or "-"
        print(f"{n:<24}{t:>8.2f}{t / v_time:>8.3f}{d:>14.2f}{1 - d / v_dummy:>10.1%}"
              f"{tok:>16.1f}{tok / v_tok:>7.2f}{det:>17.2f}{steps:>12.0f}{moved:>9}  {lat_s}")
    print(f"identical responses across all {len(names)} rollouts: {len(shas) == 1}")
    side, plain = runs["natural-f1+tg+sidecar"], "natural-f1+tg"

    def total(r, job, key):
        return sum(p["jobs"].get(job, {}).get(key, 0) for p in r["pool"].values())

    leased = statistics.median(r["rank_seconds"]["leased"] for r in side)
    served = statistics.median(total(r, "sidecar", "served") for r in side)
    restarts = statistics.median(total(r, "sidecar", "restarts") for r in side)
    tokens = statistics.median(total(r, "sidecar", "tokens") for r in side)
    scored = statistics.median(total(r, "rewards", "scored") for r in side)
    distinct = statistics.median(total(r, "sidecar", "distinct") for r in side)
    accuracy = statistics.median(total(r, "sidecar", "correct") / max(total(r, "sidecar", "distinct"), 1)
                                 for r in side)
    slow = med("natural-f1+tg+sidecar", lambda r: r["rollout_time_s"]) / med(plain, lambda r: r["rollout_time_s"]) - 1
    print(f"sidecar ({sidecar['sidecar.checkpoint']}), per rollout (median): {leased:.2f} leased rank-s "
          f"served {served:.0f} held-out queries ({tokens:.0f} tokens; each detached rank serves its share "
          f"in repeated passes) with {restarts:.0f} restarts after pre-emption, and scored {scored:.0f} "
          f"responses; accuracy {accuracy:.1%} over the {distinct:.0f} distinct queries answered (each "
          f"counted once); primary rollout slowdown vs the same run without side work: {slow:+.1%} "
          f"(paper: 2-3% on GPUs; here ranks share CPU cores)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({n: rs for n, rs in runs.items()}, fh, indent=1)
    return 0 if len(shas) == 1 else 1


def sidecar_inputs(folder: str) -> dict:
    """The sidecar's trained checkpoint and held-out queries, made first if `folder` lacks them."""
    from pathlib import Path

    out = Path(folder)
    if not (out / "model" / "config.json").exists() or not (out / "heldout.jsonl").exists():
        import subprocess

        print(f"bench_elastic: training the sidecar model into {out} (tools/make_sidecar_model.py)...",
              file=sys.stderr, flush=True)
        subprocess.run([sys.executable, str(Path(__file__).parent / "make_sidecar_model.py"), "--out", str(out)],
                       check=True)
    return {"sidecar.checkpoint": str(out / "model"), "sidecar.queries": str(out / "heldout.jsonl")}


if __name__ == "__main__":
    sys.exit(main())
