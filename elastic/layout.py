"""Layouts: which rank runs each response of the batch.

`natural` is verl's placement: the batch in data order, cut into W contiguous chunks whose sizes
differ by at most one (as `DataProto.chunk` / `numpy.array_split` cut it).
"""
from __future__ import annotations

from typing import Sequence

from elastic.plan import Assignment


def natural(batch: Sequence[tuple[str, int]], ranks: int) -> list[Assignment]:
    """`batch` is the responses as (prompt_id, sample) in data order."""
    n = len(batch)
    base, extra = divmod(n, ranks)
    out, start = [], 0
    for r in range(ranks):
        size = base + (1 if r < extra else 0)
        out.extend(Assignment(pid, s, r) for pid, s in batch[start:start + size])
        start += size
    return out
