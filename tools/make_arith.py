"""Write the synthetic arithmetic prompt set as JSONL (one {prompt_id, prompt, answer} per line).

    python tools/make_arith.py --out examples/data/arith_train.jsonl --n 400 --seed 0
    python tools/make_arith.py --out examples/data/arith_heldout.jsonl --heldout-of examples/data/arith_train.jsonl
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import json

from megatron_rl.data.arith import heldout_problems, make_problems, write_jsonl
from tools.tool_args import add_problem_set_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_problem_set_args(p, n=400)
    p.add_argument("--max-operand", type=int, default=20, help="operands are 0..MAX")
    p.add_argument("--ops", default="+", help="operators to draw from, e.g. '+-'")
    p.add_argument("--heldout-of", help="write every problem of the space this JSONL file lacks instead")
    args = p.parse_args()
    if args.heldout_of:
        train = [json.loads(line) for line in Path(args.heldout_of).read_text().splitlines() if line.strip()]
        rows = heldout_problems(train, args.max_operand, args.ops)
    else:
        rows = make_problems(args.n, args.seed, args.max_operand, args.ops)
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} problems to {args.out}")


if __name__ == "__main__":
    main()
