"""The busiest rank's share of a batch of point-to-point moves.

Moves between distinct pairs run at once (the runtime's loop blocks only the two ranks of each move;
the simulator books them so), so a batch of moves takes about as long as the rank that sends or
receives the most. Expert moves (`CostModel.transfer_s`, `calibrate_transitions`) and KV moves
(`OnlineRule`, the simulator's migrations) are priced by this one tally.
"""
from __future__ import annotations

from collections.abc import Iterable


def busiest_load(moves: Iterable[tuple[int, int, float]]) -> float:
    """The largest total any one rank sends or receives over `moves`, each `(src, dst, amount)`
    (bytes or seconds); 0.0 for no moves. A rank's sends and receives are tallied apart."""
    load: dict[tuple[str, int], float] = {}
    for src, dst, amount in moves:
        for key in (("tx", src), ("rx", dst)):
            load[key] = load.get(key, 0.0) + amount
    return max(load.values(), default=0.0)
