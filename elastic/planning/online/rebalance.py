"""Between shrinks the online rule rebalances: live requests move inside the group so that the work
its members are expected to do over the next checks is even, since a step waits for the member
holding the most. `even_out` proposes the moves; the rule (`OnlineRule._rebalance`) prices them
and keeps them only if they pay.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from elastic.planning.online.place import LiveState


def even_out(kept: Sequence[int], now: LiveState, prompt: np.ndarray, held: Callable, horizon: int,
             room: dict[int, float], slots: int | None, stays: dict[int, int] | None) -> list[tuple[int, int]]:
    """Moves (response, destination) that even out the KV the members `kept` are expected to hold
    over the next `horizon` decode steps, with the fewest moves, each to whichever member holds
    least: with `stays` (each rank's place in the leaving order, 0 staying longest), only among
    those that stay at least as long as the sender, so a rebalance never loads a rank the next
    shrink would have to empty. A move must fit the receiver's KV `room` (in positions of the
    run's cache, `held(positions, more)`) and its `slots` (None: unbounded); a balanced group
    proposes no move at all."""
    live, rank_of, tokens, rem = now.live, now.rank_of, now.tokens, now.rem
    kept = list(kept)
    positions = prompt[live] + tokens[live]
    soon = np.minimum(rem, horizon)
    work = (soon * (positions[None, :] + soon / 2)).mean(axis=0)
    need = held(positions, rem.max(axis=0))
    where = rank_of[live]
    on = {r: np.flatnonzero(where == r).tolist() for r in kept}  # each member's movable requests (columns), ascending
    # Each member's work and KV, its requests' summed in column order (bincount adds in input order).
    size = max(kept) + 1
    load = dict(zip(kept, np.bincount(where, work, minlength=size)[kept].tolist()))
    kv = dict(zip(kept, np.bincount(where, need, minlength=size)[kept].tolist()))
    count = {r: len(on[r]) for r in kept}
    moves = []
    for _ in range(len(kept)):
        hi = max(kept, key=lambda r: (load[r], -r))
        lo = min((r for r in kept if stays is None or stays[r] <= stays[hi]), key=lambda r: (load[r], r))
        gap = load[hi] - load[lo]
        cand = np.array(on[hi], dtype=np.int64)
        fits = cand[(work[cand] < gap) & (kv[lo] + need[cand] <= room[lo])]
        if not len(fits) or count[lo] >= (slots or len(live)):
            break
        col = int(fits[np.argmin(np.abs(gap / 2 - work[fits]))])  # ties: the first column
        on[hi].remove(col)  # a moved request stays put for the rest of this rebalance
        for r, sign in ((hi, -1), (lo, 1)):
            load[r] += sign * work[col]
            kv[r] += sign * need[col]
            count[r] += sign
        moves.append((int(live[col]), lo))
    return moves
