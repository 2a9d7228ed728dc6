"""Time the planner: one 16-rank, 1,024-response plan per policy (the issue's budget: under 1 s).

    python tools/bench_planner.py [--repeat 5] [--large] [--quality]

Each policy is planned `--repeat` times on epoch 5 of the DeepScaleR-like preset (128 prompts x 8
samples, five epochs of history) and the best and median wall times are printed beside the 1 s
budget. `--large` adds a 256-rank, 16,384-response plan (the simulator's scale). `--quality` replays
every policy's plans on the true lengths of epochs 1-5 of each preset with the planner's own coarse
estimate (`elastic.planning.chains.estimate.replay`, default `ShapeCost`) and prints rollout time and occupied and
detached rank-seconds against vanilla, side by side. The simulator (`flexfloor simulate`) is the
decode-step-granular judge; this table only shows what the planner believes it is optimising.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from elastic.planning.chains.estimate import replay
from elastic.planning.choices import PlanChoices
from elastic.planning.dims import planned_dims
from elastic.planning.lengths.guard import TailGuard
from elastic.planning.lengths.predict import Predictor
from elastic.planning.planner import plan_epoch
from elastic.planning.platform import Platform
from elastic.planning.shape import ModelShape
from elastic.planning.step_cost import ShapeCost
from elastic.sim.synth import generate, preset

POLICIES = [  # name, layout, floor (None: the case's floor), tailguard, oracle
    ("vanilla", "natural", "W", False, False),
    ("lengthsort+TG", "lengthsort", "W", True, False),
    ("natural floor2+TG", "natural", 2, True, False),
    ("planned floor4", "planned", 4, False, False),
    ("planned floor4+TG", "planned", 4, True, False),
    ("oracle floor4", "planned", 4, False, True),
]


def timed(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, min(times), statistics.median(times)


def bench(label, trace, epoch, ranks, repeat):
    shape = ModelShape()
    n = len(trace.epoch(epoch))
    print(f"\n{label}: {ranks} ranks, {n} responses, history {len(trace.before(epoch))} records")
    hist = trace.before(epoch)
    _, best, med = timed(lambda: Predictor(hist), repeat)
    print(f"  {'predictor fit':24s} best {best * 1e3:7.1f} ms  median {med * 1e3:7.1f} ms")
    _, best, med = timed(lambda: TailGuard.fit(hist), repeat)
    print(f"  {'TailGuard fit':24s} best {best * 1e3:7.1f} ms  median {med * 1e3:7.1f} ms")
    worst = 0.0
    for name, layout, floor, tg, oracle in POLICIES:
        kw = {"platform": Platform(planned_dims(ranks, shape.num_experts), shape), "layout": layout,
              "choices": PlanChoices(ranks if floor == "W" else floor, tg), "oracle": oracle}
        plan, best, med = timed(lambda kw=kw: plan_epoch(trace, epoch, **kw), repeat)
        worst = max(worst, med)
        print(f"  {name:24s} best {best * 1e3:7.1f} ms  median {med * 1e3:7.1f} ms  "
              f"chain {plan.meta['chain']} ({plan.meta['chains_feasible']} feasible)")
    return worst


QUALITY = POLICIES[:3] + [("planned floor4+TG", "planned", 4, True, False),
                          ("planned floor4+TG rollout", "planned", 4, True, False),
                          ("oracle floor4", "planned", 4, False, True)]


def quality(name: str, seed: int) -> None:
    shape = ModelShape()
    cost = ShapeCost(shape)
    platform = Platform(planned_dims(16, shape.num_experts), shape)
    trace = generate(preset(name), seed=seed)
    totals = {}
    for label, layout, floor, tg, oracle in QUALITY:
        acc = np.zeros(3)
        for e in trace.epochs[1:]:
            batch = trace.epoch(e)
            choices = PlanChoices(16 if floor == "W" else floor, tg,
                                  "rollout" if label.endswith("rollout") else "occupied")
            plan = plan_epoch(trace, e, platform=platform, layout=layout, choices=choices, oracle=oracle)
            est = replay(plan, {r.key: r.response_len for r in batch},
                         float(np.mean([r.prompt_len for r in batch])), cost)
            acc += (est.rollout_s, est.occupied_rank_s, est.detached_rank_s)
        totals[label] = acc
    base = totals["vanilla"]
    print(f"\n{name} seed {seed}, 16 ranks, epochs 1-5 summed (planner's replay estimate):")
    for label, (T, occ, det) in totals.items():
        print(f"  {label:26s} rollout {T:7.1f} s ({T / base[0] - 1:+6.1%})  occupied "
              f"{occ:8.0f} rank-s ({occ / base[1] - 1:+6.1%})  detached {det:7.0f} rank-s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--large", action="store_true", help="also plan 256 ranks x 16k responses")
    parser.add_argument("--quality", action="store_true",
                        help="also replay every policy on the presets' true lengths")
    args = parser.parse_args(argv)
    trace = generate(preset("deepscaler"), seed=0)
    worst = bench("DeepScaleR-like", trace, 5, 16, args.repeat)
    print(f"\nslowest policy median {worst:.3f} s = {worst / 1.0:.2f} x the 1 s budget "
          f"({'within' if worst < 1.0 else 'OVER'})")
    if args.large:
        big = generate(preset("deepscaler", prompts=2048, epochs=3), seed=0)
        worst = bench("DeepScaleR-like, simulator scale", big, 2, 256, max(1, args.repeat // 5))
        print(f"\nslowest policy median at 256 ranks: {worst:.2f} s")
    if args.quality:
        for name in ("deepscaler", "eurus", "nosignal"):
            quality(name, seed=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
