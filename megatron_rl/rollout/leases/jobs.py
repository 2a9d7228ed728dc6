"""Side work a detached rank can lease (see `elastic/runtime/pool.py`), and how a run picks it.

- `RewardScoringJob`: scores this rank's already finished responses while the tail still decodes,
  so the reward phase after the rollout has less left to do. The score function is the caller's
  (the trainer passes its task reward; the rollout CLI, which replays traces with synthetic prompts
  and has no task, passes `distinct_ngram_reward`, a degeneracy score RL recipes use as a penalty).
- the sidecar (`megatron_rl/rollout/leases/sidecar.py`): a held-out query queue served by a real
  checkpoint, on this process's torch engine (`sidecar`) or on a colocated sglang engine
  (`sglang`, GPU only, `megatron_rl/rollout/leases/sglang.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from elastic.runtime.pool import IdlePool
from megatron_rl.config import require, require_seconds
from megatron_rl.rollout.elastic_engines.faults import KillSelfJob, StuckJob
from megatron_rl.rollout.engine import Request
from megatron_rl.rollout.leases.sglang import SGLangSidecarJob
from megatron_rl.rollout.leases.sidecar import SidecarConfig, SidecarJob

LEASE_JOBS = ("rewards", "sidecar", "sglang")
# A sidecar's counts that a rollout's report gives as this rollout's work (the rest are so far).
SIDECAR_COUNTS = ("served", "tokens", "restarts")


def check_lease_jobs(jobs: list[str], where: str) -> None:
    bad = sorted(set(jobs) - set(LEASE_JOBS))
    require(not bad, f"{where}: unknown job {bad[0] if bad else ''!r}; jobs are {', '.join(LEASE_JOBS)}")
    require(not {"sidecar", "sglang"} <= set(jobs),
            f"{where}: 'sidecar' and 'sglang' serve the same queue; choose one")


@dataclass
class LeaseConfig:
    """The side work of detached ranks (`leases:` of both `flexfloor rollout` and `train`)."""

    jobs: list[str] = field(default_factory=lambda: ["rewards"])
    lease_s: float = 60.0  # longest single lease
    grace_s: float = 5.0  # how long a pre-empted lease may take to yield before LeaseTimeout
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)
    fault: Literal["stuck-lease"] | None = None  # testing only: the first detached rank's lease hangs

    def __post_init__(self):
        check_lease_jobs(self.jobs, "leases.jobs")
        if {"sidecar", "sglang"} & set(self.jobs):
            self.sidecar.check("leases.jobs", self.grace_s)
        require_seconds(self.lease_s, "leases.lease_s")
        require_seconds(self.grace_s, "leases.grace_s")


def distinct_ngram_reward(tokens: list[int], n: int = 4) -> float:
    """Share of distinct n-grams in a response: 1.0 for no repetition, near 0 for a loop."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


class RewardScoringJob:
    """Scores `finished` (a list the engine appends to) one response at a time; `scores[key]`."""

    name = "rewards"

    def __init__(self, finished: list[Request], score: Callable[[Request], Any]):
        self.finished, self.score = finished, score
        self.scores: dict[tuple[str, int], Any] = {}

    def done(self) -> bool:
        return len(self.scores) >= len(self.finished)

    def run(self, preempted: Callable[[], bool]) -> None:
        for r in list(self.finished):
            if preempted():
                return
            if r.key not in self.scores:
                self.scores[r.key] = self.score(r)

    def report(self) -> dict:
        return {"scored": len(self.scores)}


def lease_jobs(names: list[str], *, finished: list[Request], score: Callable[[Request], Any],
               sidecar=None, fault: str | None = None) -> list:
    """The jobs a detached rank leases, in order: training work first, then the sidecar.

    `sidecar`: the rank's sidecar job, built by the caller (a trainer keeps one across steps so the
    model loads once). `fault` (`kill-leased-rank` / `stuck-lease`) puts the injected job first.
    """
    jobs: list = []
    if fault == "kill-leased-rank":
        jobs.append(KillSelfJob())
    elif fault == "stuck-lease":
        jobs.append(StuckJob())
    if "rewards" in names:
        jobs.append(RewardScoringJob(finished, score))
    if sidecar is not None:
        jobs.append(sidecar)
    return jobs


def sidecar_job(names: list[str], cfg, rank: int, world: int):
    """The sidecar lease `names` ask for (torch engine or sglang), or None."""
    if "sidecar" in names:
        return SidecarJob(cfg, rank, world)
    if "sglang" in names:
        return SGLangSidecarJob(cfg, rank, world)
    return None


@dataclass
class LeaseOutcome:
    """What one rank's leases did in one rollout: the verdict (the score function's value) of each
    response its reward scoring job scored, by key, and its sidecar's work (`SIDECAR_COUNTS` in this
    rollout, `correct` and `distinct` queries so far; empty without a sidecar)."""

    scored: dict[tuple[str, int], Any] = field(default_factory=dict)
    sidecar: dict = field(default_factory=dict)


class RolloutLeases:
    """One rank's leases in one rollout: the idle pool it serves while detached (`pool`), and what
    its jobs did (`outcome`). `sidecar`: the rank's sidecar job among `jobs`, if any (a trainer keeps
    one across rollouts: its work in this one is counted from now)."""

    def __init__(self, cfg: LeaseConfig, jobs: list, sidecar=None):
        self.pool = IdlePool(jobs, lease_s=cfg.lease_s, grace_s=cfg.grace_s)
        self.rewards = next((j for j in jobs if isinstance(j, RewardScoringJob)), None)
        self.sidecar = sidecar
        self.sidecar_before = {} if sidecar is None else sidecar.report()

    @classmethod
    def build(cls, cfg: LeaseConfig, finished: list[Request], score: Callable[[Request], Any], sidecar=None,
              fault: str | None = None) -> RolloutLeases:
        """`lease_jobs`' jobs (`cfg.jobs`) in one pool."""
        return cls(cfg, lease_jobs(cfg.jobs, finished=finished, score=score, sidecar=sidecar, fault=fault), sidecar)

    def outcome(self) -> LeaseOutcome:
        scored = {} if self.rewards is None else dict(self.rewards.scores)
        if self.sidecar is None:
            return LeaseOutcome(scored)
        now = self.sidecar.report()
        work = {k: now[k] - self.sidecar_before.get(k, 0) for k in SIDECAR_COUNTS}
        work.update(correct=now["correct"], distinct=now["distinct"])
        return LeaseOutcome(scored, work)
