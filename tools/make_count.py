"""Write the length-tailed counting task ("17,23=" -> "17 18 19 20 21 22 23") as JSONL.

    python tools/make_count.py --out examples/data/count_train.jsonl --n 64 --seed 0
    python tools/make_count.py --out examples/data/count_heldout.jsonl --n 32 --seed 1 \
        --exclude examples/data/count_train.jsonl --id-prefix heldout
    python tools/make_count.py --out examples/data/count_sft.jsonl --n 600 --seed 2 \
        --exclude examples/data/count_heldout.jsonl --id-prefix sft

One {prompt_id, prompt, answer} per line (`megatron_rl/data/count.py`); `--exclude` draws only
problems those files lack. `examples/tiny_cpu_tailed.yaml` trains on the first (RL: 64 problems that
recur every 4 steps), evaluates on the second and warm-starts on the third (SFT: many problems, so
the model learns to count, not the RL set by heart).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_rl.data.arith import write_jsonl
from megatron_rl.data.count import make_count_problems
from tools.tool_args import add_problem_set_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_problem_set_args(p, n=64)
    p.add_argument("--max-value", type=int, default=99, help="numbers are 0..MAX")
    p.add_argument("--max-span", type=int, default=60, help="the longest count, b - a")
    p.add_argument("--long-share", type=float, default=0.2, help="share of problems with a span of 5 or more")
    p.add_argument("--exclude", action="append", default=[], help="draw only problems this JSONL file lacks")
    p.add_argument("--id-prefix", default="count", help="prompt ids are PREFIX-00000, ...")
    args = p.parse_args()
    exclude = {json.loads(line)["prompt"] for f in args.exclude for line in Path(f).read_text().splitlines()
               if line.strip()}
    rows = make_count_problems(args.n, args.seed, args.max_value, args.max_span, args.long_share, exclude,
                               args.id_prefix)
    write_jsonl(rows, args.out)
    lengths = sorted(len(r["answer"]) + 1 for r in rows)  # + EOS
    print(f"wrote {len(rows)} problems to {args.out}; response tokens {lengths[0]}..{lengths[-1]}, "
          f"median {lengths[len(lengths) // 2]}")


if __name__ == "__main__":
    main()
