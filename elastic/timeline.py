"""Per-rank timelines of a rollout: each rank's ledger laid out over wall time.

A `RankTimeline` is fed the same `(state, seconds, steps)` entries as its rank's `RankLedger`
(`RankLedger.add` forwards every one), in the order they happen, and keeps them as segments:
consecutive entries of one state merge into one segment, so recording costs one comparison per
ledger entry (no clock read, no device sync; the runtime already times every tick for the ledger).
Events (a stage change, a live-request migration, a lease starting or ending) are marks at the
rank's clock position when they happen. Everything here is pure data (the simulator feeds the
same recorder), and the segments conserve the ledger: per rank and state, their durations sum to
the ledger's rank-seconds and their steps to its rank-steps (`Timeline.check`).

Lease marks come from the idle pool's report: a detached rank serves its leases back to back from
the moment it detaches (`IdlePool.serve`), then idles until the restore, so its detached span is
its `leased` segment followed by its `idle` one, and lease i starts where the ones before it end.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Mark kinds, in the order a figure's legend lists them.
MARKS = ("stage", "migrate", "lease-start", "lease-end")


class RankTimeline:
    """One rank's segments and marks on its own clock (seconds since its start)."""

    def __init__(self) -> None:
        self.states: list[str] = []
        self.seconds: list[float] = []
        self.steps: list[int] = []
        self.marks: list[tuple[float, str, str]] = []  # (at_s, kind, label)
        self.now = 0.0

    def add(self, state: str, seconds: float, steps: int = 1) -> None:
        if seconds == 0 and steps == 0:
            return
        if self.states and self.states[-1] == state:
            self.seconds[-1] += seconds
            self.steps[-1] += steps
        else:
            self.states.append(state)
            self.seconds.append(seconds)
            self.steps.append(steps)
        self.now += seconds

    def mark(self, kind: str, label: str = "") -> None:
        if kind not in MARKS:
            raise ValueError(f"unknown timeline mark {kind!r}; kinds are {MARKS}")
        self.marks.append((self.now, kind, label))

    def lead(self, state: str, seconds: float) -> None:
        """Time before this rank's first entry (it left the start barrier after the first rank):
        everything recorded so far moves later by `seconds`."""
        if seconds <= 0:
            return
        if self.states and self.states[0] == state:
            self.seconds[0] += seconds
        else:
            self.states.insert(0, state)
            self.seconds.insert(0, seconds)
            self.steps.insert(0, 0)
        self.marks = [(t + seconds, k, lab) for t, k, lab in self.marks]
        self.now += seconds

    def to_dict(self) -> dict:
        starts = [0.0]
        for s in self.seconds[:-1]:
            starts.append(starts[-1] + s)
        return {"segments": [[st, t, s, n] for st, t, s, n in zip(self.states, starts, self.seconds, self.steps)],
                "marks": [list(m) for m in self.marks]}

    @classmethod
    def from_dict(cls, d: dict) -> "RankTimeline":
        tl = cls()
        for state, _, seconds, steps in d.get("segments", []):
            tl.add(state, seconds, steps)
        tl.marks = [(float(t), k, lab) for t, k, lab in d.get("marks", [])]
        return tl


@dataclass
class Segment:
    rank: int
    state: str
    start_s: float
    seconds: float
    steps: int

    @property
    def end_s(self) -> float:
        return self.start_s + self.seconds


@dataclass
class Mark:
    rank: int
    at_s: float
    kind: str
    label: str


@dataclass
class Timeline:
    """A whole rollout's per-rank timelines on one clock: 0 is the first rank's start, `wall_s`
    the last rank's end (the ledger's T)."""

    ranks: int
    wall_s: float
    segments: list[Segment]
    marks: list[Mark]
    title: str = ""

    @classmethod
    def of(cls, per_rank: list[dict], wall_s: float, pools: dict | None = None, title: str = "") -> "Timeline":
        """From the ledgers' `to_dict()` (a report's `per_rank`) and the idle pools' reports by rank
        (a report's `pool`), which place the lease marks."""
        segments, marks = [], []
        for d in per_rank:
            r = int(d["rank"])
            tl = d.get("timeline", {})
            mine = [Segment(r, st, float(t), float(s), int(n)) for st, t, s, n in tl.get("segments", [])]
            segments += mine
            marks += [Mark(r, float(t), k, lab) for t, k, lab in tl.get("marks", [])]
            leases = (pools or {}).get(str(r), {}).get("leases", [])
            detached = next((s.start_s for s in mine if s.state in ("leased", "idle")), None)
            if leases and detached is not None:
                at = detached
                for lease in leases:
                    marks.append(Mark(r, at, "lease-start", lease["job"]))
                    at += float(lease["seconds"])
                    marks.append(Mark(r, at, "lease-end", lease.get("ended", "")))
        return cls(len(per_rank), float(wall_s), segments, sorted(marks, key=lambda m: (m.rank, m.at_s)), title)

    @classmethod
    def of_report(cls, report: dict, title: str = "") -> "Timeline":
        """From a rollout's report (`flexfloor rollout --out DIR`'s report.json)."""
        return cls.of(report["per_rank"], report["rollout_time_s"], report.get("pool"), title)

    @classmethod
    def of_ledger(cls, ledger, pools: list[dict] | None = None, title: str = "") -> "Timeline":
        """From an assembled `Ledger` and each rank's idle-pool report (in rank order)."""
        by_rank = {str(r.rank): p for r, p in zip(ledger.ranks, pools or []) if p}
        return cls.of([r.to_dict() for r in ledger.ranks], ledger.wall_s, by_rank, title)

    def check(self, ledger, tolerance_s: float = 1e-9) -> None:
        """The segments conserve the ledger: per rank and state, their seconds sum to the ledger's
        (to float rounding: the two sums add the same numbers in a different grouping) and their
        steps to its steps exactly; each rank's segments tile [0, T] without gap or overlap."""
        for r in ledger.ranks:
            mine = [s for s in self.segments if s.rank == r.rank]
            for state, want in r.seconds.items():
                got = math.fsum(s.seconds for s in mine if s.state == state)
                if abs(got - want) > tolerance_s * max(1.0, abs(want)):
                    raise AssertionError(f"timeline: rank {r.rank} {state} segments sum to {got!r} s, "
                                         f"the ledger has {want!r}")
                steps = sum(s.steps for s in mine if s.state == state)
                if steps != r.steps[state]:
                    raise AssertionError(f"timeline: rank {r.rank} {state} segments hold {steps} steps, "
                                         f"the ledger has {r.steps[state]}")
            for a, b in zip(mine, mine[1:]):
                if abs(a.end_s - b.start_s) > tolerance_s * max(1.0, b.start_s):
                    raise AssertionError(f"timeline: rank {r.rank} has a gap or overlap at {a.end_s!r} s")
            end = mine[-1].end_s if mine else 0.0
            if abs(end - self.wall_s) > 1e-6 * max(1.0, self.wall_s):
                raise AssertionError(f"timeline: rank {r.rank} ends at {end!r} s, the rollout at {self.wall_s!r}")

    def columns(self) -> list[str]:
        return ["rank", "state", "start_s", "end_s", "seconds", "steps"]

    def rows(self) -> list[list]:
        """One row per segment (a W&B table)."""
        return [[s.rank, s.state, s.start_s, s.end_s, s.seconds, s.steps] for s in self.segments]
