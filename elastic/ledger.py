"""The rank-time ledger: the unit of every performance claim (docs/design.md).

Every rank-second of a rollout of wall time T on W ranks is exactly one of five states. Steps are
counted on the global decode-step clock (one tick per synchronous EP step of the active group), so a
detached rank accrues a `leased` or `idle` step for every tick it misses; the step ledger therefore
sums to W x T_steps exactly. Seconds are each rank's own wall clock between the common start and end
barriers, so they sum to W x T within clock skew (checked to 1%).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from elastic.timeline import RankTimeline

STATES = ("busy", "dummy", "transition", "leased", "idle")
OCCUPIED = ("busy", "dummy", "transition")
DETACHED = ("leased", "idle")


@dataclass
class RankLedger:
    rank: int
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATES, 0.0))
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES, 0))
    # The same entries laid out over time (elastic/timeline.py), when they are added one by one.
    timeline: RankTimeline = field(default_factory=RankTimeline, repr=False, compare=False)

    def add(self, state: str, seconds: float, steps: int = 1) -> None:
        if state not in self.seconds:
            raise ValueError(f"unknown ledger state {state!r}; states are {STATES}")
        self.seconds[state] += seconds
        self.steps[state] += steps
        self.timeline.add(state, seconds, steps)

    def lead(self, state: str, seconds: float) -> None:
        """Seconds (no steps) before this rank's first entry, e.g. waiting at the start barrier."""
        self.seconds[state] += seconds
        self.timeline.lead(state, seconds)

    def mark(self, kind: str, label: str = "") -> None:
        """An event on this rank's timeline now (`elastic.timeline.MARKS`)."""
        self.timeline.mark(kind, label)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "seconds": dict(self.seconds), "steps": dict(self.steps),
                "timeline": self.timeline.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "RankLedger":
        return cls(d["rank"], dict(d["seconds"]), dict(d["steps"]), RankTimeline.from_dict(d.get("timeline", {})))


@dataclass
class Ledger:
    """The whole rollout's ledger, assembled on rank 0 from every rank's `RankLedger`."""

    ranks: list[RankLedger]
    wall_s: float
    total_steps: int

    @property
    def world(self) -> int:
        return len(self.ranks)

    def rank_seconds(self) -> dict[str, float]:
        return {s: sum(r.seconds[s] for r in self.ranks) for s in STATES}

    def rank_steps(self) -> dict[str, int]:
        return {s: sum(r.steps[s] for r in self.ranks) for s in STATES}

    def check(self, seconds_tolerance: float = 0.01) -> None:
        """Conservation: steps sum to W x T_steps exactly; seconds to W x T within the tolerance."""
        for r in self.ranks:
            if sum(r.steps.values()) != self.total_steps:
                raise AssertionError(
                    f"ledger: rank {r.rank} accounts {sum(r.steps.values())} steps, "
                    f"the rollout took {self.total_steps}"
                )
        want = self.world * self.wall_s
        got = sum(self.rank_seconds().values())
        if want > 0 and abs(got - want) > seconds_tolerance * want:
            raise AssertionError(f"ledger: {got:.4f} rank-seconds accounted, W x T = {want:.4f}")

    def summary(self, response_tokens: int) -> dict:
        secs = self.rank_seconds()
        occupied = sum(secs[s] for s in OCCUPIED)
        total = sum(secs.values())
        return {
            "ranks": self.world,
            "rollout_time_s": self.wall_s,
            "rollout_steps": self.total_steps,
            "rank_seconds": secs,
            "rank_steps": self.rank_steps(),
            "dummy_share": secs["dummy"] / total if total else 0.0,
            "occupied_rank_s": occupied,
            "detached_rank_s": sum(secs[s] for s in DETACHED),
            "response_tokens": response_tokens,
            "tokens_per_occupied_rank_s": response_tokens / occupied if occupied else 0.0,
        }


def format_report(summary: dict) -> str:
    """The human-readable ledger table printed by `flexfloor demo` and `flexfloor rollout`."""
    secs, steps = summary["rank_seconds"], summary["rank_steps"]
    total = sum(secs.values()) or 1.0
    lines = [
        f"rollout: {summary['ranks']} ranks, {summary['rollout_time_s']:.2f} s wall, "
        f"{summary['rollout_steps']} steps, {summary['response_tokens']} response tokens",
        f"{'state':<11}{'rank-s':>10}{'share':>9}{'rank-steps':>12}",
    ]
    for s in STATES:
        lines.append(f"{s:<11}{secs[s]:>10.2f}{secs[s] / total:>8.1%}{steps[s]:>12d}")
    lines.append(f"{'total':<11}{sum(secs.values()):>10.2f}{1:>8.1%}{sum(steps.values()):>12d}")
    lines.append(
        f"dummy share {summary['dummy_share']:.1%}; "
        f"{summary['tokens_per_occupied_rank_s']:.1f} response tokens per occupied rank-second"
    )
    return "\n".join(lines)
