"""A synthetic task with a length tail a tiny MoE can learn on CPU: count from a to b.

"17,23=" -> "17 18 19 20 21 22 23". The response's length is the prompt's: a span of one gives 3
to 5 characters, a span of 60 about 180, so a batch's shortest and longest responses differ some
40x, and the few long prompts are the tail the elastic rollout cuts. Each step is local (add one,
copy the end from the prompt), so the SFT warm start learns it well enough to succeed sometimes and
GRPO has something to improve. Problems are distinct (a, b) pairs, so a prompt id names one problem
and the same lengths recur every epoch: the history predictor has something to learn.
The character alphabet needed is `ALPHABET`.
"""
from __future__ import annotations

import numpy as np

from megatron_rl.errors import FlexFloorError

ALPHABET = "0123456789 ,="


def count_problem(a: int, b: int, prompt_id: str) -> dict:
    return {"prompt_id": prompt_id, "prompt": f"{a},{b}=", "answer": " ".join(str(x) for x in range(a, b + 1))}


def make_count_problems(n: int, seed: int, max_value: int = 99, max_span: int = 60,
                        long_share: float = 0.2, exclude: set[str] | frozenset = frozenset(),
                        id_prefix: str = "count") -> list[dict]:
    """`n` distinct problems `a,b=` with 0 <= a < b <= max_value, none of whose prompts is in
    `exclude`. The span b - a is 1..4 for most; a `long_share` of them draw it log-uniformly in
    5..max_span: the tail."""
    if not 5 <= max_span <= max_value or not 0 <= long_share <= 1:
        raise FlexFloorError(f"count: expected 5 <= max_span <= max_value and 0 <= long_share <= 1, got "
                             f"max_span {max_span}, max_value {max_value}, long_share {long_share}")
    rng = np.random.default_rng(seed)
    seen, rows = set(exclude), []
    for _ in range(100 * n):
        if len(rows) == n:
            break
        if rng.random() < long_share:
            span = int(np.exp(rng.uniform(np.log(5), np.log(max_span + 1))))
        else:
            span = int(rng.integers(1, 5))
        span = min(span, max_span)
        a = int(rng.integers(0, max_value - span + 1))
        row = count_problem(a, a + span, f"{id_prefix}-{len(rows):05d}")
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    if len(rows) < n:
        raise FlexFloorError(f"count: drew only {len(rows)} distinct problems of {n} "
                             f"(max_value {max_value}, max_span {max_span})")
    return rows
