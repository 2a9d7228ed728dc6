"""`adaptive` against the oracle and vanilla in the simulator, on synthetic traces with several seeds.

    python tools/bench_adaptive.py                       # 16 ranks, 4 traces x 3 seeds
    python tools/bench_adaptive.py --ablation            # + adaptive without each online part
    python tools/bench_adaptive.py --scale 64,256 --seeds 1

Each trace (tools/make_trace.py presets: `deepscaler`, `eurus`, `trunc` = deepscaler cut at 4,096
tokens, `nosignal`; `--traces held-out`: five more with the presets' parameters moved, which no
constant was chosen on) is generated with `--history` epochs before the rollout epoch, which is the one
simulated. Per trace and objective it prints, summed over seeds:
- `rollout` objective: rollout-time cut against vanilla, and adaptive's share of the oracle's cut;
- `occupied` objective: tokens per occupied rank-second against vanilla, and adaptive's share of
  the oracle's gain;
- the slowest adaptive rollout against vanilla's (the goal: never more than 1% slower);
- planning time (the offline plan) and the online rule's time per rollout (all its decisions).
With `--scale`, the deepscaler trace with the batch grown with the ranks (128 prompts per 16 ranks).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.planning.lengths.remaining import OnlineOptions
from elastic.planning.shape import ModelShape
from elastic.sim.costmodel import CostModel
from elastic.sim.replay import Policy, make_policy_plan, make_policy_rule
from elastic.sim.simulate import SimConfig, simulate_rollout
from elastic.sim.synth import generate, preset

TRACES = {"deepscaler": ("deepscaler", {}), "eurus": ("eurus", {}),
          "trunc": ("deepscaler", {"cap": 4096}), "nosignal": ("nosignal", {})}
DEFAULT_TRACES = ",".join(TRACES)
# Traces no constant was chosen on (`--traces held-out`): the presets with their parameters moved.
HELD_OUT = {"weak": ("deepscaler", {"prompt_share": 0.35, "drift": 0.06}),
            "wide": ("deepscaler", {"sigma": 1.0, "hard_share": 0.25, "hard_factor": 4.0}),
            "short": ("eurus", {"median": 450.0, "cap": 2048}),
            "growing": ("deepscaler", {"trend": 0.08, "median": 1500.0}),
            "flat": ("nosignal", {"sigma": 0.5})}
TRACES.update(HELD_OUT)
ABLATIONS = {"-conditional": OnlineOptions(conditional=False), "-siblings": OnlineOptions(siblings=False),
             "-migrate": OnlineOptions(migrate=False)}


def run(trace, policy: Policy, ranks: int, cost: CostModel, shape: ModelShape, config: SimConfig) -> dict:
    e = trace.epochs[-1]
    batch, history = trace.epoch(e), trace.before(e)
    t0 = time.perf_counter()
    plan = make_policy_plan(policy, batch, history, ranks=ranks, shape=shape, cost=cost)
    rule = make_policy_rule(policy, plan, batch, history, shape=shape, cost=cost, config=config)
    plan_s = time.perf_counter() - t0
    online = [0.0]
    if rule is not None:
        decide = rule.decide

        def timed(*a):
            t = time.perf_counter()
            out = decide(*a)
            online[0] += time.perf_counter() - t
            return out
        rule.decide = timed
    res = simulate_rollout(plan, batch, cost, shape, config, rule)
    occupied = ranks * res.ledger.wall_s - sum(
        r.seconds["idle"] + r.seconds["leased"] for r in res.ledger.ranks)
    return {"T": res.ledger.wall_s, "tokens": res.response_tokens, "occupied": occupied, "plan_s": plan_s,
            "online_s": online[0], "shrinks": sum(1 for t in res.transitions if t[2] != 0),
            "migrated": res.migrated, "final": min(n for _, n in res.timeline)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=DEFAULT_TRACES)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--floor", type=int, default=4)
    ap.add_argument("--history", type=int, default=2, help="epochs of history before the rollout")
    ap.add_argument("--scale", default="", help="rank counts for the scale check (deepscaler only)")
    ap.add_argument("--objectives", default="rollout,occupied")
    ap.add_argument("--ablation", action="store_true")
    args = ap.parse_args(argv)
    cost, shape, config = CostModel(), ModelShape(), SimConfig()
    names = args.traces.replace("held-out", ",".join(HELD_OUT)).split(",")
    unknown = [n for n in names if n and n not in TRACES]
    if unknown:
        ap.error(f"unknown trace {unknown[0]!r}; traces are {', '.join(TRACES)} (or held-out)")
    cases = [(name, args.ranks) for name in names if name]
    cases += [("deepscaler", int(w)) for w in args.scale.split(",") if w]
    print("| trace | ranks | objective | policy | rollout s | vs vanilla | tok/occupied rank-s vs vanilla "
          "| share of oracle | plan s | online s | shrinks | migrated | final group |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, ranks in cases:
        preset_name, kw = TRACES[name]
        prompts = 128 * ranks // 16
        floor = max(args.floor * ranks // 16, 1)
        traces = [generate(preset(preset_name, epochs=args.history + 1, prompts=prompts, **kw), seed=s)
                  for s in range(args.seeds)]
        van = [run(t, Policy("vanilla", ranks), ranks, cost, shape, config) for t in traces]
        vT, vtok, vocc = (sum(v[k] for v in van) for k in ("T", "tokens", "occupied"))
        for objective in args.objectives.split(","):
            base = Policy("adaptive", floor, True, objective=objective)
            policies = [Policy("oracle", floor, objective=objective), base]
            if args.ablation:
                policies += [replace(base, online=o) for o in ABLATIONS.values()]
            gains = {}
            for pol in policies:
                rs = [run(t, pol, ranks, cost, shape, config) for t in traces]
                T, tok, occ = (sum(r[k] for r in rs) for k in ("T", "tokens", "occupied"))
                cut, gain = 1 - T / vT, (tok / occ) / (vtok / vocc) - 1
                worst = max(r["T"] / v["T"] - 1 for r, v in zip(rs, van))
                gains[pol.label] = (cut, gain)
                if pol.kind.oracle:
                    oracle = (cut, gain)
                    share = ""
                else:
                    mine, theirs = (cut, oracle[0]) if objective == "rollout" else (gain, oracle[1])
                    share = f"{mine / theirs:.0%}" if theirs > 0 else "n/a"
                print(f"| {name} | {ranks} | {objective} | {pol.label} | {T:.1f} | {-cut:+.1%} (worst seed "
                      f"{worst:+.1%}) | x{1 + gain:.3f} | {share} | {max(r['plan_s'] for r in rs):.2f} "
                      f"| {max(r['online_s'] for r in rs):.1f} | {sum(r['shrinks'] for r in rs)} "
                      f"| {sum(r['migrated'] for r in rs)} | {min(r['final'] for r in rs)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
