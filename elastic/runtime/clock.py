"""One rank's clock over an elastic rollout: the global tick count and the rank-time ledger.

Each decode step and each shrink or restore is one tick of the global clock; every span of this
rank's time is booked to exactly one ledger state (docs/design.md), from the end of the last span
booked (`t_prev`) to now, so the seconds conserve.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from elastic.ledger import RankLedger


@dataclass
class RankClock:
    ledger: RankLedger
    t0: float  # `time.perf_counter()` at the start (after the setup's barrier)
    start_wall: float  # the same instant on the shared wall clock (`time.time()`)
    t_prev: float  # the end of the last span booked
    tick: int = 0

    @classmethod
    def start(cls, ledger: RankLedger) -> RankClock:
        t0 = time.perf_counter()
        return cls(ledger, t0, time.time(), t0)

    def book(self, state: str) -> float:
        """End the tick in `state`: its seconds go to the ledger (and are returned)."""
        now = time.perf_counter()
        seconds = now - self.t_prev
        self.ledger.add(state, seconds)
        self.t_prev, self.tick = now, self.tick + 1
        return seconds

    def settle(self, state: str, steps: int = 1) -> float:
        """Book the time since the last span to `state` as `steps` steps, without a tick of the
        global clock (a restore's tick is counted once, by the rank that posted the ticks, and the
        final barrier's wait is none); the seconds."""
        now = time.perf_counter()
        seconds = now - self.t_prev
        self.ledger.add(state, seconds, steps)
        self.t_prev = now
        return seconds

    def pace_s(self, ticks: int) -> float:
        """Seconds per tick so far, over the first `ticks` ticks (those up to the last span booked)."""
        return (self.t_prev - self.t0) / ticks
