"""Fault injection, for testing that failures end runs cleanly (config field `fault`).

Each fault hits the first rank the plan detaches (the lowest rank leaving at stage 1):
- `kill-leased-rank`: that rank's lease SIGKILLs its own process mid-lease.
- `fail-transfer`: that rank's first expert send during a shrink raises.
- `stuck-lease`: that rank's lease ignores pre-emption.
In every case the run must end within the collective timeout with one error naming the rank, stage
and phase, with the finished responses and the ledger so far on disk.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable

from elastic.planning.plan import Plan

FAULTS = ("kill-leased-rank", "fail-transfer", "stuck-lease")


def fault_rank(plan: Plan) -> int | None:
    if len(plan.stages) < 2:
        return None
    leaving = set(plan.stages[0].members) - set(plan.stages[1].members)
    return min(leaving)


class KillSelfJob:
    name = "fault-kill"

    def done(self) -> bool:
        return False

    def run(self, preempted: Callable[[], bool]) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def report(self) -> dict:
        return {}


class StuckJob:
    name = "fault-stuck"

    def done(self) -> bool:
        return False

    def run(self, preempted: Callable[[], bool]) -> None:
        end = time.monotonic() + 3600  # bounded, but far past any grace period
        while time.monotonic() < end:
            time.sleep(0.05)

    def report(self) -> dict:
        return {}


class FailingExport:
    """Wraps an ElasticEngine so its first `export_expert` raises."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def export_expert(self, expert: int):
        raise OSError(f"injected fault: sending expert {expert} failed")
