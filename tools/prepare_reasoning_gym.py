"""Write a reasoning-gym task as verl-format parquet files and a verl-signature reward file.

    pip install -e '.[tasks]'       # reasoning-gym (Apache-2.0): ~100 procedural tasks, offline
    python tools/prepare_reasoning_gym.py --task basic_arithmetic --out runs/data/basic_arithmetic \\
        --params '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                   "operators": ["+", "-"], "allow_parentheses": false, "allow_negation": false}'

OUT/train.parquet and OUT/heldout.parquet hold rows in the layout of verl's preprocessors
(`data_source` = the task, `prompt` = one user message with the task's question, `ability`,
`reward_model: {style: rule, ground_truth}`, `extra_info: {split, index, question, metadata}`), the
two drawn from disjoint seeds (`--seed`, `--seed + 1`): the held-out file is fresh draws of the
task, so its reward is the task's expected reward. A task with a small question space repeats
questions across the two (the count is printed); `--unseen-only` keeps only held-out questions the
training file lacks, which measures generalisation instead. OUT/reward.py defines
`compute_score(data_source, solution_str, ground_truth, extra_info)` through the task's own
`score_answer`. Use them as any user's verl files:

    data: {path: OUT/train.parquet}
    eval: {path: OUT/heldout.parquet, every: 5}
    reward: {kind: custom, path: OUT/reward.py}
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REWARD_PY = '''"""verl-signature reward for the reasoning-gym task {task!r} (tools/prepare_reasoning_gym.py):
the task's own `score_answer` on the entry the row was made from."""
import json

import reasoning_gym

_SCORE = reasoning_gym.get_score_answer_fn({task!r})


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    info = extra_info or {{}}
    entry = {{"question": info.get("question", ""), "answer": ground_truth,
             "metadata": json.loads(info.get("metadata", "{{}}"))}}
    return float(_SCORE(solution_str.strip(), entry))
'''


def rows(task: str, params: dict, size: int, seed: int, split: str, skip: set[str] = frozenset()) -> list[dict]:
    """`size` draws of `task` in verl's layout, leaving out the questions in `skip`."""
    import reasoning_gym

    out = []
    for entry in reasoning_gym.create_dataset(task, size=size, seed=seed, **params):
        if entry["question"] in skip:
            continue
        out.append({
            "data_source": task,
            "prompt": [{"role": "user", "content": entry["question"]}],
            "ability": entry["metadata"].get("source_dataset", task),
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            # metadata as JSON text: its nested values differ per task (tuples, mixed types), which
            # a parquet column cannot hold as such.
            "extra_info": {"split": split, "index": len(out), "question": entry["question"],
                           "metadata": json.dumps(entry["metadata"], default=str)},
        })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, help="a reasoning-gym dataset name, e.g. basic_arithmetic")
    p.add_argument("--out", required=True, help="folder for train.parquet, heldout.parquet, reward.py")
    p.add_argument("--params", default="{}", help="the task's config fields, as a JSON object")
    p.add_argument("--train", type=int, default=400, help="training rows drawn")
    p.add_argument("--heldout", type=int, default=100, help="held-out rows drawn")
    p.add_argument("--unseen-only", action="store_true",
                   help="leave out held-out questions the training file holds (and repeats)")
    p.add_argument("--seed", type=int, default=0, help="training seed; the held-out file uses seed + 1")
    args = p.parse_args()
    try:
        import datasets
        import reasoning_gym  # noqa: F401
    except ImportError as e:
        sys.exit(f"prepare_reasoning_gym: {e.name} is not installed (pip install -e '.[tasks]')")
    params = json.loads(args.params)
    train = rows(args.task, params, args.train, args.seed, "train")
    seen = {r["extra_info"]["question"] for r in train}
    heldout = rows(args.task, params, args.heldout, args.seed + 1, "test")
    if args.unseen_only:
        unique = {r["extra_info"]["question"]: r for r in heldout if r["extra_info"]["question"] not in seen}
        heldout = [{**r, "extra_info": {**r["extra_info"], "index": i}} for i, r in enumerate(unique.values())]
    if not heldout:
        sys.exit(f"prepare_reasoning_gym: every held-out question of {args.task} is in the training file; "
                 "widen the task (--params) or draw fewer training rows")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(train).to_parquet(str(out / "train.parquet"))
    datasets.Dataset.from_list(heldout).to_parquet(str(out / "heldout.parquet"))
    (out / "reward.py").write_text(REWARD_PY.format(task=args.task))
    repeated = sum(r["extra_info"]["question"] in seen for r in heldout)
    print(f"wrote {len(train)} training rows ({len(seen)} distinct questions) and {len(heldout)} held-out "
          f"rows ({repeated} of them with a question training holds) of {args.task} to {out} (+ reward.py)")


if __name__ == "__main__":
    main()
