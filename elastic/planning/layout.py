"""Layouts: which rank runs each response of the batch.

- `natural` is verl's placement: the batch in data order, cut into W contiguous chunks whose sizes
  differ by at most one (as `DataProto.chunk` / `numpy.array_split` cut it).
- `lengthsort` balances predicted work: longest first, each to the rank with the least predicted
  work so far (LPT) that still has KV room.
- `planned` is planned residency: ranks are filled in the reverse of their leaving order (the
  resident ranks that stay to the floor first), longest predicted responses first, each tier of
  ranks that leave together up to its share of the predicted work (as balanced as `lengthsort`),
  so residents hold a few long responses, the leaving ranks many short ones, and those drain early
  and together. Within a tier a response goes to the least-loaded rank.

KV safety: every rank's KV demand over the rollout (`kv.Demand`, from each response's prompt and
predictive or guarded length distribution) stays within `budget[r]`, the KV tokens rank r may
hold at the tightest stage it belongs to; otherwise the layout raises `PlanError`. Responses are
placed longest reserved length first (the TailGuard bound, or the predicted tail), so the long
ones choose their ranks while there is room.

`layout_kind(name)` is each layout as the planner uses it (`LayoutKind`): the chain search and the
planner ask it how the layout places instead of comparing names.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from elastic.planning.choices import LAYOUTS
from elastic.planning.memory.kv import RankKV
from elastic.planning.plan import Assignment, PlanError


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


def placement_order(reserve: Sequence[float], work: Sequence[float]) -> list[int]:
    """Response indices, longest reserved length first (ties: more work, then data order)."""
    return sorted(range(len(reserve)), key=lambda i: (-reserve[i], -work[i], i))


def lengthsort(order: Sequence[int], work: Sequence[float], ranks: int, kv: RankKV,
               keys: Sequence[tuple[str, int]]) -> list[int]:
    """Rank of each response (by index); `order` from `placement_order`."""
    rank_of = [0] * len(order)
    heap = [(0.0, r) for r in range(ranks)]
    for i in order:
        r = _least_loaded(heap, i, work, kv)
        if r is None:
            _no_room(keys, i, kv)
        rank_of[i] = r
    return rank_of


def planned(order: Sequence[int], work: Sequence[float], tiers: Sequence[Sequence[int]],
            kv: RankKV, keys: Sequence[tuple[str, int]]) -> list[int]:
    """Rank of each response (by index); `tiers` lists the ranks by leaving stage, residents
    first, first leavers last."""
    share = float(np.sum(work)) / sum(len(t) for t in tiers)
    rank_of = [0] * len(order)
    pos, carry = 0, 0.0
    for t, tier in enumerate(tiers):
        last = t == len(tiers) - 1
        heap = [(0.0, r) for r in tier]
        quota = share * len(tier) + carry
        taken = 0.0
        while pos < len(order) and (last or taken < quota):
            i = order[pos]
            r = _least_loaded(heap, i, work, kv)
            if r is None:
                break
            rank_of[i] = r
            taken += work[i]
            pos += 1
        carry = quota - taken
    if pos < len(order):
        _no_room(keys, order[pos], kv)
    return rank_of


def _least_loaded(heap: list[tuple[float, int]], i: int, work: Sequence[float], kv: RankKV):
    """Place response i on the least-loaded rank of `heap` with KV room; None if there is none."""
    load, r = heap[0]
    if kv.fits(r, i):
        heapq.heapreplace(heap, (load + work[i], r))
        kv.add(r, i)
        return r
    full = [heapq.heappop(heap)]
    while heap and not kv.fits(heap[0][1], i):
        full.append(heapq.heappop(heap))
    found = None
    if heap:
        load, found = heapq.heappop(heap)
        kv.add(found, i)
        heapq.heappush(heap, (load + work[i], found))
    for item in full:
        heapq.heappush(heap, item)
    return found


def check_kv(rank_of: Sequence[int], kv: RankKV) -> None:
    """Raise `PlanError` if a rank's KV demand under `rank_of` (by response index) exceeds its budget."""
    per_rank: dict[int, list[int]] = {}
    for i, r in enumerate(rank_of):
        per_rank.setdefault(r, []).append(i)
    for r, idx in sorted(per_rank.items()):
        peak = kv.d.peak(idx)
        if peak > kv.budget[r]:
            raise PlanError(f"KV cache cannot fit: rank {r} would hold up to {peak:.0f} KV tokens "
                            f"for its responses but has room for {max(kv.budget[r], 0):.0f}")


def _no_room(keys: Sequence[tuple[str, int]], i: int, kv: RankKV):
    need, prompt, largest = kv.own[i], kv.d.prompt[i], max(kv.budget)
    if need > largest:
        raise PlanError(f"KV cache cannot fit: response {keys[i]} alone needs up to {need:.0f} KV "
                        f"tokens (its prompt is {prompt:.0f}), more than any rank has room for "
                        f"({max(largest, 0):.0f})")
    raise PlanError(f"KV cache cannot fit: response {keys[i]} fits on no rank that may take it; "
                    f"the most room any rank has left is {max(kv.room(), 0):.0f} tokens")


def _natural_ranks(keys: Sequence[tuple[str, int]], order: Sequence[int], work: Sequence[float], ranks: int,
                   kv: RankKV) -> list[int]:
    """`natural`'s rank of each response (by index), checked against the KV budgets."""
    index = {k: i for i, k in enumerate(keys)}
    rank_of = [0] * len(keys)
    for a in natural(keys, ranks):
        rank_of[index[(a.prompt_id, a.sample)]] = a.rank
    check_kv(rank_of, kv)
    return rank_of


def _lengthsort_ranks(keys: Sequence[tuple[str, int]], order: Sequence[int], work: Sequence[float], ranks: int,
                      kv: RankKV) -> list[int]:
    return lengthsort(order, work, ranks, kv, keys)


@dataclass(frozen=True)
class LayoutKind:
    """A layout as the planner uses it. `place_once(keys, order, work, ranks, kv)`: a baseline places
    every response once, on all ranks before any shrink, and a chain then only decides who stays;
    None: it places anew for each chain's tiers (`planned`). `weak`: the layout it places as when the
    predictor explains too little of the length variance (residency built on noise would only
    concentrate random long responses); None: itself."""

    name: str
    place_once: Callable[..., list[int]] | None = None
    weak: str | None = None

    def placed_as(self, weak: bool) -> str:
        """The layout it places as, given whether the predictor is weak."""
        return self.weak if weak and self.weak else self.name


_LAYOUT_KINDS = {k.name: k for k in (
    LayoutKind("natural", place_once=_natural_ranks),
    LayoutKind("lengthsort", place_once=_lengthsort_ranks),
    LayoutKind("planned", weak="lengthsort"),
)}


def layout_kind(name: str) -> LayoutKind:
    """The layout `name` (one of `LAYOUTS`)."""
    if name not in _LAYOUT_KINDS:
        raise PlanError(f"layout: expected one of {', '.join(LAYOUTS)}, got {name!r}")
    return _LAYOUT_KINDS[name]
