"""`flexfloor predict` (its flags: megatron_rl/cli/predict.py): the length predictor's and TailGuard's
quality on a trace, per epoch."""
from __future__ import annotations

import json

from elastic.planning.lengths.guard import report
from elastic.planning.lengths.predict import infer_cap
from elastic.planning.lengths.remaining import SiblingFit
from elastic.trace import read_trace
from megatron_rl.errors import FlexFloorError


def run(args) -> int:
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
