import time

import pytest

from elastic.runtime.pool import IdlePool, LeaseTimeout


class Counter:
    """A cooperative job: one unit of work per 10 ms, checking pre-emption between units."""

    def __init__(self, name="count", units=10_000):
        self.name, self.units, self.n = name, units, 0

    def done(self):
        return self.n >= self.units

    def run(self, preempted):
        while not preempted() and not self.done():
            time.sleep(0.01)
            self.n += 1

    def report(self):
        return {"units": self.n}


class Deaf(Counter):
    def run(self, preempted):
        time.sleep(3.0)


def stop_after(seconds):
    end = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= end


def test_restore_preempts_the_lease_and_reports_work():
    pool = IdlePool([Counter()], lease_s=60.0, grace_s=1.0)
    leased, report = pool.serve(stop_after(0.3))
    assert 0.2 < leased < 1.0
    assert report["jobs"]["count"]["units"] > 5
    assert report["leases"][0]["ended"] == "preempted"


def test_no_lease_runs_past_the_predicted_restoration():
    pool = IdlePool([Counter()], lease_s=60.0, grace_s=1.0)
    start = time.perf_counter()
    leased, report = pool.serve(stop_after(0.6), restore_by=start + 0.2)
    assert report["leases"][0]["ended"] == "deadline"
    assert leased < 0.45  # the rank idled from the predicted restoration until the real one


def test_finished_jobs_are_not_leased_again():
    jobs = [Counter("a", units=3), Counter("b", units=3)]
    leased, report = IdlePool(jobs, grace_s=1.0).serve(stop_after(0.5))
    assert [lease["ended"] for lease in report["leases"]] == ["finished", "finished"]
    assert all(j.done() for j in jobs)


def test_a_lease_that_ignores_preemption_is_an_error():
    pool = IdlePool([Deaf("deaf")], grace_s=0.2)
    with pytest.raises(LeaseTimeout, match="lease 'deaf' did not yield within 0.2s"):
        pool.serve(stop_after(0.1))
