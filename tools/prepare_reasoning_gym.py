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
`score_answer`. OUT is a new or empty folder, or one this tool wrote before (it carries
`.flexfloor-export` and is replaced whole), by the rule of `flexfloor export --to`
(megatron_rl/files/owned_paths.py): any other folder is refused and left as it is. Bad counts, tasks and
`--params` are one line (exit 2) naming the choices. Use the files as any user's verl files:

    data: {path: OUT/train.parquet}
    eval: {path: OUT/heldout.parquet, every: 5}
    reward: {kind: custom, path: OUT/reward.py}
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elastic.errors import InputError, shorten
from megatron_rl.errors import FlexFloorError
from megatron_rl.files.owned_paths import check_export_target, replace_folder

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
    import reasoning_gym  # optional (the `tasks` extra): checked in main

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


def task_fields(task: str) -> list[str]:
    """The config fields `--params` may set for `task` (seed and size are --seed's and --train's),
    or one line listing the tasks."""
    from reasoning_gym.factory import DATASETS  # optional (the `tasks` extra): checked in main

    if task not in DATASETS:
        raise FlexFloorError(f"--task {shorten(task, 60)}: not a reasoning-gym task; the tasks: "
                             f"{', '.join(sorted(DATASETS))}")
    return [f.name for f in dataclasses.fields(DATASETS[task][1]) if f.name not in ("seed", "size")]


def task_params(task: str, text: str) -> dict:
    """`--params` for `task`: a JSON object of the task's config fields, or one line listing them."""
    fields = task_fields(task)
    try:
        params = json.loads(text)
    except ValueError as e:
        raise FlexFloorError(f"--params: not JSON ({e}); expected an object of {task}'s fields: "
                             f"{', '.join(fields)}") from None
    if not isinstance(params, dict):
        raise FlexFloorError(f"--params: expected a JSON object of {task}'s fields ({', '.join(fields)}), got "
                             f"{shorten(text, 60)}")
    unknown = [k for k in params if k not in fields]
    if unknown:
        raise FlexFloorError(f"--params: {task} has no field {shorten(unknown[0], 60)!r} (seed and size are "
                             f"--seed's and --train's); its fields: {', '.join(fields)}")
    return params


def check_count(flag: str, n: int) -> None:
    if n <= 0:
        raise FlexFloorError(f"{flag} {n}: expected a positive number of rows")


def draw(args: argparse.Namespace, params: dict) -> tuple[list[dict], list[dict]]:
    """The training and held-out rows; the task's own refusal of `params` is one line."""
    try:
        train = rows(args.task, params, args.train, args.seed, "train")
        seen = {r["extra_info"]["question"] for r in train}
        heldout = rows(args.task, params, args.heldout, args.seed + 1, "test")
    except Exception as e:  # the task's code raises what it likes (AssertionError, TypeError)  # noqa: BLE001
        fields = ", ".join(task_fields(args.task))
        raise FlexFloorError(f"--params {shorten(json.dumps(params), 200)}: {args.task} refused them "
                             f"({type(e).__name__}: {shorten(e)}); its fields: {fields}") from None
    if args.unseen_only:
        unique = {r["extra_info"]["question"]: r for r in heldout if r["extra_info"]["question"] not in seen}
        heldout = [{**r, "extra_info": {**r["extra_info"], "index": i}} for i, r in enumerate(unique.values())]
    if not heldout:
        raise FlexFloorError(f"every held-out question of {args.task} is in the training file; widen the task "
                             "(--params) or draw fewer training rows")
    return train, heldout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, help="a reasoning-gym dataset name, e.g. basic_arithmetic")
    p.add_argument("--out", required=True, help="folder for train.parquet, heldout.parquet, reward.py: a new "
                                                "or empty one, or one this tool wrote before (replaced whole)")
    p.add_argument("--params", default="{}", help="the task's config fields, as a JSON object")
    p.add_argument("--train", type=int, default=400, help="training rows drawn")
    p.add_argument("--heldout", type=int, default=100, help="held-out rows drawn")
    p.add_argument("--unseen-only", action="store_true",
                   help="leave out held-out questions the training file holds (and repeats)")
    p.add_argument("--seed", type=int, default=0, help="training seed; the held-out file uses seed + 1")
    args = p.parse_args()
    try:
        import datasets  # noqa: F401  (optional: the `tasks` extra)
        import reasoning_gym  # noqa: F401
    except ImportError as e:
        print(f"prepare_reasoning_gym: {e.name} is not installed (pip install -e '.[tasks]')", file=sys.stderr)
        return 1
    try:
        check_count("--train", args.train)
        check_count("--heldout", args.heldout)
        params = task_params(args.task, args.params)
        check_export_target(args.out, None, "--out")  # only a folder of ours is replaced
        train, heldout = draw(args, params)
        replace_folder(Path(args.out), lambda tmp: write(tmp, args.task, train, heldout))
    except InputError as e:
        print(f"prepare_reasoning_gym: error: {e}", file=sys.stderr)
        return 2
    seen = {r["extra_info"]["question"] for r in train}
    repeated = sum(r["extra_info"]["question"] in seen for r in heldout)
    print(f"wrote {len(train)} training rows ({len(seen)} distinct questions) and {len(heldout)} held-out "
          f"rows ({repeated} of them with a question training holds) of {args.task} to {args.out} (+ reward.py)")
    return 0


def write(folder: Path, task: str, train: list[dict], heldout: list[dict]) -> None:
    import datasets  # optional (the `tasks` extra): checked in main

    datasets.Dataset.from_list(train).to_parquet(str(folder / "train.parquet"))
    datasets.Dataset.from_list(heldout).to_parquet(str(folder / "heldout.parquet"))
    (folder / "reward.py").write_text(REWARD_PY.format(task=task))


if __name__ == "__main__":
    sys.exit(main())
