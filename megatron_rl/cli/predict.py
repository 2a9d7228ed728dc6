"""`flexfloor predict`: the length predictor's and TailGuard's quality on a trace, per epoch.

    flexfloor predict --trace dsr.jsonl [--alpha 0.05] [--json]

Every epoch that has an earlier one is predicted from the epochs before it only. Columns:
Spearman rank correlation of predicted and true lengths, mean absolute error (tokens), calibration
(share of responses at or below the predicted median and 90% quantile: ideally 0.50 and 0.90), the
share of length variance that belongs to the prompt (icc), TailGuard's margin and achieved miss
rate (target: alpha), and `sib`: how much a response's finished siblings in the same rollout tell
beyond the history's prediction (the online model's sibling share, fitted from the epochs before;
`adaptive` uses it, docs/planner.md).
"""
from __future__ import annotations

import argparse
import json

from megatron_rl.errors import FlexFloorError


def register(subparsers) -> None:
    p = subparsers.add_parser("predict", help="length predictor and TailGuard quality per epoch",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="length trace (JSON Lines, see docs/planner.md)")
    p.add_argument("--alpha", type=float, default=0.05, help="TailGuard's target miss rate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from elastic.planning.lengths.guard import report
    from elastic.planning.lengths.predict import infer_cap
    from elastic.planning.lengths.remaining import SiblingFit
    from elastic.trace import read_trace

    if not 0 < args.alpha < 1:
        raise FlexFloorError(f"--alpha: expected a value in (0, 1), got {args.alpha}")
    trace = read_trace(args.trace)
    if len(trace.epochs) < 2:
        raise FlexFloorError(f"{args.trace}: needs at least two epochs to evaluate a "
                             f"prediction, has {len(trace.epochs)}")
    rows = report(trace, args.alpha)
    cap = infer_cap(list(trace))
    for r in rows:
        r["siblings"] = SiblingFit.fit(trace.before(r["epoch"]), cap=cap).to_dict()
    if args.json:
        print(json.dumps({"trace": args.trace, "alpha": args.alpha, "epochs": rows}))
        return 0
    print(f"{'epoch':>5} {'resp':>6} {'spearman':>8} {'MAE':>7} {'cal@.5':>6} {'cal@.9':>6} "
          f"{'icc':>5} {'margin':>6} {'miss':>6} {'sib':>5}")
    for r in rows:
        tg = r["tailguard"]
        print(f"{r['epoch']:>5} {r['responses']:>6} {r['spearman']:>8.3f} {r['mae']:>7.0f} "
              f"{r['calibration']['0.5']:>6.3f} {r['calibration']['0.9']:>6.3f} {r['icc']:>5.2f} "
              f"{'cap' if tg['margin'] is None else format(tg['margin'], '.2f'):>6} "
              f"{tg['miss_rate']:>6.3f} {r['siblings']['icc']:>5.2f}")
    print(f"TailGuard target miss rate {args.alpha:.3f}; mean achieved "
          f"{sum(r['tailguard']['miss_rate'] for r in rows) / len(rows):.3f}")
    return 0
