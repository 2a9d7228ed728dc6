"""TailGuard: conformal margins and their achieved miss rate."""
import math

import pytest

from elastic.planning.lengths.guard import TailGuard, miss_rate, report
from elastic.planning.lengths.predict import Predictor
from elastic.sim.synth import generate, preset
from elastic.trace import Trace, TraceRecord


@pytest.mark.parametrize("name", ["deepscaler", "eurus"])
def test_miss_rate_within_two_points_per_epoch(name):
    """Strong per-prompt persistence: over 4 seeds x 5 epochs, the achieved miss rate is within
    alpha +- 2 points in at least 18 of 20 epochs, never off by more than 2.5 points, and about
    alpha on average (TailGuard errs on the safe side: fewer misses, not more)."""
    alpha = 0.05
    rates = []
    for seed in range(4):
        rows = report(generate(preset(name), seed=seed), alpha)
        assert [r["epoch"] for r in rows] == [1, 2, 3, 4, 5]
        rates += [r["tailguard"]["miss_rate"] for r in rows]
    within = sum(abs(m - alpha) <= 0.02 for m in rates)
    assert within >= 18, rates
    assert max(abs(m - alpha) for m in rates) <= 0.025, rates
    assert abs(sum(rates) / len(rates) - alpha) <= 0.01, rates


def test_wider_alpha_keeps_its_promise():
    rates = [r["tailguard"]["miss_rate"] for r in report(generate(preset("deepscaler"), seed=5), 0.2)]
    assert abs(sum(rates) / len(rates) - 0.2) <= 0.02, rates
    assert all(abs(m - 0.2) <= 0.05 for m in rates), rates


def test_bounds_sit_above_predictions_and_below_the_cap():
    trace = generate(preset("eurus", prompts=32), seed=0)
    hist, batch = trace.before(3), trace.epoch(3)
    pred = Predictor(hist)
    guard = TailGuard.fit(hist, 0.05)
    assert guard.calibrated_on == 2
    for d in pred.predict_batch(batch):
        b = guard.bound(d)
        assert d.median <= b <= (pred.cap or math.inf)
        assert guard.guarded(d).quantile(0.95) == pytest.approx(b)


def test_truncated_responses_count_as_covered_by_the_cap():
    # Half of every epoch runs to the cap: the margin must let those prompts' bounds reach it,
    # and then none of them is a miss.
    recs = [TraceRecord(f"p{i}", e, 0, 10, 1000 if i % 2 == 0 else 100 + i, i % 2 == 0)
            for e in range(3) for i in range(40)]
    trace = Trace(recs)
    guard = TailGuard.fit(trace.before(2), 0.05)
    assert math.isfinite(guard.margin)
    batch = trace.epoch(2)
    bounds = [guard.bound(d) for d in Predictor(trace.before(2)).predict_batch(batch)]
    assert all(b == 1000 for b, r in zip(bounds, batch) if r.truncated)
    assert miss_rate(bounds, batch) <= 0.05


def test_unbounded_margin_with_too_few_responses():
    recs = [TraceRecord(f"p{i}", 0, 0, 10, 100 + i) for i in range(10)]  # 11 < 1 / 0.05
    guard = TailGuard.fit(Trace(recs), 0.05)
    assert math.isinf(guard.margin) and guard.tail_floor == 0.05 and guard.margin_or_none is None
    d = Predictor(Trace(recs), cap=500).predict("p1")
    assert guard.bound(d) == 500


def test_single_epoch_history_calibrates_on_the_population():
    trace = generate(preset("deepscaler", epochs=2), seed=4)
    guard = TailGuard.fit(trace.before(1), 0.05)
    assert guard.calibrated_on == 0 and math.isfinite(guard.margin)
    batch = trace.epoch(1)
    bounds = [guard.bound(d) for d in Predictor(trace.before(1)).predict_batch(batch)]
    assert miss_rate(bounds, batch) <= 0.08


def test_alpha_is_validated():
    with pytest.raises(ValueError, match="alpha"):
        TailGuard.fit(Trace([]), 1.5)


@pytest.mark.parametrize("tailguard", [False, True], ids=["quantile", "tailguard"])
def test_reserved_lengths_are_what_the_planner_reserves(tailguard):
    """The paged KV cache admits each response by `reserved_lengths`: the very lengths the
    planner reserves for it (placement order and KV), with and without TailGuard."""
    from elastic.planning.lengths.guard import reserved_lengths
    from elastic.planning.planner import _predicted_lengths

    trace = generate(preset("eurus", prompts=32), seed=0)
    hist, batch = trace.before(3), trace.epoch(3)
    planner = _predicted_lengths(batch, [r.key for r in batch], hist, tailguard, 0.05, None, None)
    assert reserved_lengths(batch, hist, tailguard=tailguard) == list(planner.reserve)
    # With no history nothing bounds a response: the request's cap decides (it was 1 token).
    assert reserved_lengths(batch, trace.before(0), tailguard=tailguard) == [math.inf] * len(batch)
