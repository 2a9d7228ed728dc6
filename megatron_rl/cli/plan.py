"""`flexfloor plan`: the planner's plan for one rollout of a length trace.

    flexfloor plan --trace dsr.jsonl --ranks 16 --floor 4 --tailguard --layout planned --json

The batch is the trace's epoch `--epoch` (default: the last one), planned from the epochs before
it only. `--json` prints the plan as one JSON object (`elastic.planning.plan.Plan.to_dict`); without it, a
summary: the quorum schedule, the per-rank load and the predicted release area.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

from megatron_rl.errors import FlexFloorError


def register(subparsers) -> None:
    from elastic.planning.shape import QWEN3_30B_A3B_H100, SHAPES

    p = subparsers.add_parser("plan", help="plan one rollout of a length trace",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="length trace (JSON Lines, see docs/planner.md)")
    p.add_argument("--epoch", type=int, default=None, help="epoch to plan (default: the last)")
    p.add_argument("--ranks", type=int, default=16, help="ranks W (default: 16)")
    p.add_argument("--floor", type=int, default=None,
                   help="fewest ranks the EP group may shrink to (default: W, nobody leaves)")
    p.add_argument("--layout", choices=("natural", "lengthsort", "planned"), default="natural")
    p.add_argument("--tailguard", action="store_true", help="size KV with TailGuard's bounds")
    p.add_argument("--alpha", type=float, default=0.05,
                   help="TailGuard's target miss rate and the KV risk level (default: 0.05)")
    p.add_argument("--oracle", action="store_true", help="plan with the true lengths (the bound)")
    p.add_argument("--objective", choices=("occupied", "rollout"), default="occupied",
                   help="pick the chain with the fewest occupied rank-seconds (default) or the "
                        "shortest predicted rollout")
    p.add_argument("--backend", choices=("torch", "megatron"), default="torch",
                   help="MoE backend the plan must suit: megatron (megatron-core's contiguous expert "
                        "blocks) allows only group sizes that divide the expert count (default: torch)")
    p.add_argument("--model", choices=sorted(SHAPES), default=QWEN3_30B_A3B_H100.name,
                   help="model and hardware shape (default: %(default)s)")
    p.add_argument("--max-response-len", type=int, default=None,
                   help="generation cap (default: inferred from truncated history records)")
    p.add_argument("--seed", type=int, default=0, help="seed of the planner's length samples")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from elastic.planning.plan import BACKEND_OWNERSHIP, PlanError
    from elastic.planning.planner import plan_epoch
    from elastic.planning.shape import SHAPES
    from elastic.trace import TraceError, read_trace

    try:
        trace = read_trace(args.trace)
        epoch = trace.epochs[-1] if args.epoch is None else args.epoch
        plan = plan_epoch(trace, epoch, ranks=args.ranks,
                          floor=args.ranks if args.floor is None else args.floor,
                          shape=SHAPES[args.model], layout=args.layout, tailguard=args.tailguard,
                          alpha=args.alpha, oracle=args.oracle,
                          max_response_len=args.max_response_len, seed=args.seed,
                          objective=args.objective, ownership=BACKEND_OWNERSHIP[args.backend])
    except (TraceError, PlanError) as e:
        raise FlexFloorError(str(e)) from None
    if args.json:
        print(json.dumps(plan.to_dict()))
        return 0
    m = plan.meta
    print(f"plan for epoch {epoch} of {args.trace}: {len(plan.assignments)} responses on "
          f"{plan.ranks} ranks, layout {plan.layout}"
          f"{' (placed as ' + m['effective_layout'] + ')' if m['effective_layout'] != plan.layout else ''}"
          f", floor {plan.floor}, TailGuard {'on' if plan.tailguard else 'off'}, ownership {plan.ownership}")
    counts = Counter(a.rank for a in plan.assignments)
    for i, st in enumerate(plan.stages):
        trigger = f"after ranks {list(st.drained)} drain" if i else "at start"
        moved = len(plan.transfers(i - 1, i)) if i else 0
        print(f"  stage {i}: {len(st.members)} ranks {trigger}"
              f"{f', {moved} expert moves' if i else ''}")
    print("  responses per rank: " + " ".join(f"{r}:{counts.get(r, 0)}" for r in range(plan.ranks)))
    print(f"  predicted rollout {m['predicted_rollout_s']:.1f} s "
          f"(nobody leaving: {m['predicted_static_rollout_s']:.1f} s), "
          f"release area {plan.predicted_release_rank_s:.1f} rank-s, "
          f"occupied {m['predicted_occupied_rank_s']:.1f} rank-s")
    if "fallback" in m:
        print(f"  note: {m['fallback']}")
    return 0
