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


def register(subparsers) -> None:
    p = subparsers.add_parser("predict", help="length predictor and TailGuard quality per epoch",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="length trace (JSON Lines, see docs/planner.md)")
    p.add_argument("--alpha", type=float, default=0.05, help="TailGuard's target miss rate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
