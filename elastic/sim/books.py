"""What each simulated rank did, kept as the runtime's ledger keeps it (elastic/ledger.py): seconds
and ticks per state, optionally the rank's timeline, and the simulated clock.

Apart from the simulator's rollout (`simulate._Rollout`, which decides what happens) because the
booking rules are the ledger's: a member with a live request is `busy`, one without `dummy`; a
rank outside the active group is `idle`, or `leased` once a lease has started `lease_start_s`
after it detached (when leases are on). Whole stretches of steps are booked at once with numpy.
"""
from __future__ import annotations

import numpy as np

from elastic.ledger import STATES, Ledger, RankLedger
from elastic.timeline import RankTimeline

_BUSY, _DUMMY, _TRANS, _LEASED, _IDLE = (STATES.index(s) for s in ("busy", "dummy", "transition", "leased", "idle"))


class RankBooks:
    """The ledger of one simulated rollout while it runs; `ledger()` closes it."""

    def __init__(self, ranks: int, lease: bool, lease_start_s: float, timeline: bool):
        self.ranks, self.lease, self.lease_start_s = ranks, lease, lease_start_s
        self.sec = np.zeros((ranks, len(STATES)))
        self.ticks = np.zeros((ranks, len(STATES)), dtype=np.int64)
        self.now = 0.0
        self.detached_at = np.full(ranks, np.inf)
        self.timelines = [RankTimeline() for _ in range(ranks)] if timeline else None

    def mark(self, ranks, kind: str, label: str) -> None:
        """A mark on the timelines of `ranks` (when timelines are kept)."""
        for r in ranks if self.timelines is not None else ():
            self.timelines[r].mark(kind, label)

    def detach(self, ranks: np.ndarray) -> None:
        """`ranks` leave the active group now."""
        self.detached_at[ranks] = self.now

    def _detached(self, members: np.ndarray, starts: np.ndarray, durations: np.ndarray) -> None:
        """Ticks starting at `starts` (absolute seconds): every rank outside `members` is detached."""
        out = np.setdiff1d(np.arange(self.ranks), members)
        total_s, total_n = float(durations.sum()), len(durations)
        for when in np.unique(self.detached_at[out]):
            group = out[self.detached_at[out] == when]
            if self.lease:
                first = int(np.searchsorted(starts, when + self.lease_start_s, side="left"))
                leased_s, leased_n = float(durations[first:].sum()), total_n - first
            else:
                leased_s, leased_n = 0.0, 0
            self.sec[group, _LEASED] += leased_s
            self.ticks[group, _LEASED] += leased_n
            self.sec[group, _IDLE] += total_s - leased_s
            self.ticks[group, _IDLE] += total_n - leased_n
            for r in group if self.timelines is not None else ():
                tl = self.timelines[r]
                tl.add("idle", total_s - leased_s, total_n - leased_n)
                if leased_n and tl.states[-1] != "leased":
                    tl.mark("lease-start", "side work")
                tl.add("leased", leased_s, leased_n)

    def transition(self, members: np.ndarray, seconds: float) -> None:
        """One tick of `transition` for `members` (a shrink, a rebalance or the restoration)."""
        self._detached(members, np.array([self.now]), np.array([seconds]))
        self.sec[members, _TRANS] += seconds
        self.ticks[members, _TRANS] += 1
        for r in members if self.timelines is not None else ():
            self.timelines[r].add("transition", seconds)
        self.now += seconds

    def prefill(self, has: np.ndarray, seconds: float) -> None:
        """Tick 0 for every rank: `busy` where it has requests (`has`), else `dummy`."""
        members = np.arange(self.ranks)
        self.sec[members, np.where(has, _BUSY, _DUMMY)] += seconds
        self.ticks[members, np.where(has, _BUSY, _DUMMY)] += 1
        for r in members if self.timelines is not None else ():
            self.timelines[r].add("busy" if has[r] else "dummy", seconds)
        self.now += seconds

    def decode(self, members: np.ndarray, busy: np.ndarray, durations: np.ndarray) -> None:
        """Decode steps of `durations` seconds; `busy[m, t]`: member m has a live request at step t."""
        starts = self.now + np.concatenate(([0.0], np.cumsum(durations)[:-1]))
        self.sec[members, _BUSY] += (busy * durations[None, :]).sum(axis=1)
        self.sec[members, _DUMMY] += (~busy * durations[None, :]).sum(axis=1)
        self.ticks[members, _BUSY] += busy.sum(axis=1)
        self.ticks[members, _DUMMY] += (~busy).sum(axis=1)
        if self.timelines is not None:
            self._record_decode(members, busy, durations)
        self._detached(members, starts, durations)
        self.now += float(durations.sum())

    def _record_decode(self, members: np.ndarray, busy: np.ndarray, durations: np.ndarray) -> None:
        """Each member's busy and dummy runs of these steps, on its timeline."""
        clock = np.concatenate(([0.0], np.cumsum(durations)))
        for r, row in zip(members, busy):
            bounds = np.concatenate(([0], np.flatnonzero(row[1:] != row[:-1]) + 1, [len(row)]))
            for a, z in zip(bounds[:-1], bounds[1:]):
                self.timelines[r].add("busy" if row[a] else "dummy", float(clock[z] - clock[a]), int(z - a))

    def end_leases(self) -> None:
        """The restoration pre-empts every lease."""
        for tl in self.timelines or ():
            if tl.states[-1] == "leased":
                tl.mark("lease-end", "preempted")

    def ledger(self) -> Ledger:
        """The closed ledger; `Ledger.check` has passed."""
        ranks = [RankLedger(r, dict(zip(STATES, map(float, self.sec[r]))), dict(zip(STATES, map(int, self.ticks[r]))),
                            self.timelines[r] if self.timelines is not None else RankTimeline())
                 for r in range(self.ranks)]
        ledger = Ledger(ranks=ranks, wall_s=self.now, total_steps=int(self.ticks[0].sum()))
        ledger.check()
        return ledger
