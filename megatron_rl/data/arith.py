"""A synthetic arithmetic task a tiny MoE can learn on CPU: "12+7=" -> "19".

Problems are distinct (operand pairs drawn without replacement), so a prompt id names one problem.
Answers are written as plain integers; the `exact` reward compares the decoded response with them.
The character alphabet needed is `megatron_rl.data.tokenizer.DEFAULT_ALPHABET`.
"""
from __future__ import annotations

import json
import operator
from pathlib import Path

import numpy as np

from megatron_rl.errors import FlexFloorError

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def make_problems(n: int, seed: int, max_operand: int = 20, ops: str = "+") -> list[dict]:
    """`n` distinct problems `a<op>b=` with 0 <= a, b <= max_operand, as dataset rows."""
    unknown = sorted(set(ops) - set(OPS))
    if unknown or not ops:
        raise FlexFloorError(f"arith ops: expected characters from {''.join(OPS)!r}, got {ops!r}")
    space = (max_operand + 1) ** 2 * len(ops)
    if not 0 < n <= space:
        raise FlexFloorError(
            f"arith: cannot draw {n} distinct problems from {space} "
            f"(operands 0..{max_operand}, ops {ops!r})"
        )
    picks = np.random.default_rng(seed).choice(space, size=n, replace=False)
    rows = []
    for k, code in enumerate(picks.tolist()):
        op = ops[code % len(ops)]
        a, b = divmod(code // len(ops), max_operand + 1)
        rows.append({"prompt_id": f"arith-{k:05d}", "prompt": f"{a}{op}{b}=",
                     "answer": str(OPS[op](a, b))})
    return rows


def heldout_problems(train: list[dict], max_operand: int = 20, ops: str = "+") -> list[dict]:
    """Every problem of the space that `train` (rows as `make_problems` writes them) lacks, in
    order: a held-out set disjoint from it."""
    seen = {r["prompt"] for r in train}
    rows = []
    for code in range((max_operand + 1) ** 2 * len(ops)):
        op = ops[code % len(ops)]
        a, b = divmod(code // len(ops), max_operand + 1)
        if f"{a}{op}{b}=" not in seen:
            rows.append({"prompt_id": f"heldout-{len(rows):05d}", "prompt": f"{a}{op}{b}=",
                         "answer": str(OPS[op](a, b))})
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
