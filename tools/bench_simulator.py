"""Scale benchmark: one 256-rank rollout of 16,384 responses (16k cap) through the simulator.

    python tools/bench_simulator.py [--ranks 256] [--prompts 2048] [--samples 8]

Plans `vanilla` and `planned` (floor 16, TailGuard) for the last epoch of a DeepScaleR-like
synthetic trace, then times `simulate_rollout` on each, side by side, against a limit of 30 s per
rollout on a 2-core machine (exit 1 above it); the planning time is printed separately (it is the
planner's).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.planning.shape import ModelShape
from elastic.sim.costmodel import CostModel
from elastic.sim.replay import Policy, make_policy_plan
from elastic.sim.simulate import SimConfig, simulate_rollout
from elastic.sim.synth import generate, preset
from tools.tool_args import add_trace_args

LIMIT_S = 30.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=256)
    add_trace_args(ap, prompts=2048, samples=8)
    ap.add_argument("--floor", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    trace = generate(preset("deepscaler", prompts=args.prompts, samples=args.samples, epochs=2), args.seed)
    batch, history = trace.epoch(1), trace.before(1)
    cost, shape = CostModel(), ModelShape()
    print(f"{args.ranks} ranks, {len(batch)} responses, longest {max(r.response_len for r in batch)} steps")
    worst = 0.0
    for policy in (Policy("vanilla", args.ranks), Policy("planned", args.floor, True)):
        t0 = time.perf_counter()
        plan = make_policy_plan(policy, batch, history, ranks=args.ranks, shape=shape, cost=cost)
        t1 = time.perf_counter()
        res = simulate_rollout(plan, batch, cost, shape, SimConfig())
        t2 = time.perf_counter()
        worst = max(worst, t2 - t1)
        s = res.ledger.summary(res.response_tokens)
        print(f"{policy.label:28s} plan {t1 - t0:6.2f} s  simulate {t2 - t1:6.2f} s  "
              f"({s['rollout_steps']} ticks, {len(plan.stages)} stages, simulated rollout {s['rollout_time_s']:.1f} s, "
              f"dummy share {s['dummy_share']:.1%})")
    verdict = "OK" if worst < LIMIT_S else "TOO SLOW"
    print(f"slowest simulation {worst:.2f} s vs the {LIMIT_S:.0f} s limit: {verdict} ({LIMIT_S / worst:.0f}x headroom)")
    return 0 if worst < LIMIT_S else 1


if __name__ == "__main__":
    sys.exit(main())
