"""A detached rank's time, from the tick it left until the restore message (elastic/runtime/detached.py,
clock.py): every tick it missed is booked `leased` or `idle`, and its seconds conserve."""
import time

import pytest

from elastic.ledger import RankLedger
from elastic.runtime.clock import RankClock
from elastic.runtime.detached import RestoreSignal, RunEnd, serve_detached


class Store:
    """The job's key-value store, as a dict."""

    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value.encode()

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def get(self, key):
        return self.kv[key]


class Engine:
    def release_memory(self):
        return 123

    def reclaim_memory(self):
        self.reclaimed = True


class Pool:
    """Leases for 20 ms, then the coordinator's restore message arrives: 10 ticks, stage 2."""

    def __init__(self, signal):
        self.signal = signal

    def serve(self, should_stop, restore_by):
        assert not should_stop() and restore_by is not None
        time.sleep(0.02)
        self.signal.post(10, 2)
        return 0.02, {"jobs": 1}


@pytest.mark.parametrize("leases", [True, False])
def test_missed_ticks_are_leased_or_idle_and_seconds_conserve(leases):
    clock = RankClock.start(RankLedger(3))
    for state in ("busy", "busy", "dummy", "transition"):  # it left at the shrink, tick 4
        clock.book(state)
    signal = RestoreSignal(Store(), "flexfloor/rollout0/restore")
    pool = Pool(signal) if leases else None
    if not leases:
        signal.post(10, 2)
    engine = Engine()
    end = serve_detached(engine, clock, signal, pool, predicted_ticks=8.0, expert_bytes=7)
    assert end == RunEnd(10, 2, {"experts": 7, "kv_cache": 123}, {"jobs": 1} if leases else {})
    assert engine.reclaimed
    steps, seconds = clock.ledger.steps, clock.ledger.seconds
    assert steps["leased"] + steps["idle"] == 10 - 4 and clock.tick == 4
    assert (steps["leased"] > 0) == leases and seconds["leased"] == (0.02 if leases else 0.0)
    assert sum(seconds.values()) == pytest.approx(clock.t_prev - clock.t0, abs=1e-9)
    time.sleep(0.01)
    clock.settle("dummy", 0)  # the final barrier's wait: no tick, no step
    assert clock.tick == 4 and sum(steps.values()) == 10
    assert sum(seconds.values()) == pytest.approx(clock.t_prev - clock.t0, abs=1e-9)
