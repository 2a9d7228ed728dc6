"""The idle pool: a detached rank leases its time to bounded side work until restoration.

A lease is one job with a deadline. Jobs are cooperative: `job.run(preempted)` does its work in
small units and returns soon after `preempted()` turns true (a safe point: between two decode steps
of a sidecar model, between two reward evaluations). The job runs in a worker thread so that the
rank's main thread keeps watching for the restore message; pre-emption raises the flag, then waits at
most `grace_s` for the job to yield. A job that does not yield is a `LeaseTimeout`: the rank cannot
rejoin the world in bounded time, which is an error, never a silent overrun of the weight update.

Jobs run one after another, each until its lease deadline: `lease_s` after it starts, and never
past the predicted restoration; what remains of a job resumes in the next lease.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Protocol


class LeaseTimeout(RuntimeError):
    pass


class LeaseJob(Protocol):
    name: str

    def run(self, preempted: Callable[[], bool]) -> None:
        """Work until done or `preempted()`; must check it at least every few hundred ms."""

    def done(self) -> bool:
        ...

    def report(self) -> dict:
        """The work done so far (counts, tokens, ...)."""


class IdlePool:
    def __init__(self, jobs: list[LeaseJob], *, lease_s: float = 60.0, grace_s: float = 5.0,
                 poll_s: float = 0.005):
        if lease_s <= 0 or grace_s <= 0:
            raise ValueError(f"lease_s and grace_s: expected both > 0, got {lease_s}, {grace_s}")
        self.jobs, self.lease_s, self.grace_s, self.poll_s = jobs, lease_s, grace_s, poll_s
        self.leases: list[dict] = []

    def serve(self, should_stop: Callable[[], bool], restore_by: float | None = None) -> tuple[float, dict]:
        """Lease this rank's time until `should_stop()`; return (leased seconds, report).

        `restore_by` (a `time.perf_counter()` instant) is the predicted restoration: no lease runs
        past it, so a detached rank is back before the world needs it if the prediction holds.
        """
        leased = 0.0
        for job in self.jobs:
            if should_stop() or (restore_by is not None and time.perf_counter() >= restore_by):
                break
            if job.done():
                continue
            leased += self._lease(job, should_stop, restore_by)
        # Nothing left to lease: wait, idle, for the restore message.
        while not should_stop():
            time.sleep(self.poll_s)
        return leased, {"leases": self.leases, "jobs": {j.name: j.report() for j in self.jobs}}

    def _lease(self, job: LeaseJob, should_stop: Callable[[], bool], restore_by: float | None) -> float:
        start = time.perf_counter()
        deadline = min(start + self.lease_s, restore_by if restore_by is not None else float("inf"))
        flag = threading.Event()
        error: list[BaseException] = []

        def target():
            try:
                job.run(flag.is_set)
            except BaseException as e:  # surfaced in the main thread below
                error.append(e)

        worker = threading.Thread(target=target, name=f"lease-{job.name}", daemon=True)
        worker.start()
        reason = "finished"
        while worker.is_alive():
            if should_stop():
                reason = "preempted"
            elif time.perf_counter() >= deadline:
                reason = "deadline"
            else:
                worker.join(self.poll_s)
                continue
            flag.set()
            worker.join(self.grace_s)
            if worker.is_alive():
                raise LeaseTimeout(f"lease {job.name!r} did not yield within {self.grace_s:.1f}s "
                                   f"of pre-emption ({reason})")
        if error:
            raise RuntimeError(f"lease {job.name!r} failed: {error[0]}") from error[0]
        took = time.perf_counter() - start
        self.leases.append({"job": job.name, "seconds": round(took, 4), "ended": reason})
        return took
