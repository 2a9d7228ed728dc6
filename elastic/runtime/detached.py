"""A detached rank, from the tick it left until the restore (step 3 of runtime.py's collective
order): its memory freed, its time leased to the idle pool (no lease past the predicted
restoration), its cache re-allocated once the restore message arrives. The message goes through
the job's key-value store (`RestoreSignal`; runtime.py says why), posted by the coordinator, the
first member of the last stage, with the rollout's ticks and final stage.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from elastic.runtime.clock import RankClock
from elastic.runtime.interface import ElasticEngine


class IdlePoolLike:
    def serve(self, should_stop: Callable[[], bool], restore_by: float | None = None) -> tuple[float, dict]:
        """Run leases until `should_stop()`, none past `restore_by` (a `time.perf_counter()`
        instant, the predicted restoration); return (leased seconds, report). `pool.IdlePool`."""


class RestoreSignal:
    """The restore message of one rollout, under its own key of the job's store."""

    def __init__(self, store, key: str):
        self.store, self.key = store, key

    def post(self, ticks: int, stage: int) -> None:
        self.store.set(self.key, f"{ticks},{stage}")

    def posted(self) -> bool:
        return self.store.check([self.key])

    def read(self) -> tuple[int, int]:
        """(the rollout's ticks, its final stage), once posted."""
        ticks, stage = map(int, self.store.get(self.key).decode().split(","))
        return ticks, stage


@dataclass(frozen=True)
class RunEnd:
    """How a rank's decode ended: the rollout's ticks and final stage (a detached rank learns them
    from the restore message) and, for a detached rank, the bytes it freed for its leases and the
    idle pool's report."""

    total_ticks: int
    stage: int
    freed: dict = field(default_factory=dict)
    pool_report: dict = field(default_factory=dict)


def serve_detached(engine: ElasticEngine, clock: RankClock, signal: RestoreSignal, pool: IdlePoolLike | None,
                   predicted_ticks: float | None, expert_bytes: int) -> RunEnd:
    """A rank that left at tick `clock.tick`: its KV cache freed (its experts, `expert_bytes`, are
    already dropped), leased until the restore message arrives, its cache re-allocated; the ticks
    it missed go to `leased` and `idle` by its measured time."""
    detached_at = clock.tick
    freed = {"experts": expert_bytes, "kv_cache": engine.release_memory()}
    leased_s, restore_by, pool_report = 0.0, None, {}
    if predicted_ticks is not None and detached_at > 0:
        # The predicted restoration in this rank's clock: the ticks the plan expects still to
        # run, at the pace the rollout has kept so far.
        restore_by = clock.t_prev + max(0.0, predicted_ticks - detached_at) * clock.pace_s(detached_at)
    if pool is not None:
        leased_s, pool_report = pool.serve(signal.posted, restore_by)
    while not signal.posted():
        time.sleep(0.005)
    total_ticks, stage = signal.read()
    engine.reclaim_memory()
    now = time.perf_counter()
    idle_s = max(0.0, now - clock.t_prev - leased_s)
    missed = total_ticks - detached_at
    leased_steps = round(missed * leased_s / (leased_s + idle_s)) if leased_s + idle_s > 0 else 0
    clock.ledger.add("leased", leased_s, leased_steps)
    clock.ledger.add("idle", idle_s, missed - leased_steps)
    clock.t_prev = now
    return RunEnd(total_ticks, stage, freed, pool_report)
