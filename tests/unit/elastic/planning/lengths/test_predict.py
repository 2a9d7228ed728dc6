"""The history-based length predictor and its quality measures."""
import math

import pytest

from elastic.planning.lengths.predict import Predictor, score, spearman
from elastic.sim.synth import generate, preset
from elastic.trace import Trace, TraceRecord


def test_spearman_matches_hand_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties take average ranks: x ranks (0, 1.5, 1.5, 3) against y ranks (0, 1, 2, 3).
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, abs=1e-6)
    assert spearman([1, 1, 1], [1, 2, 3]) == 0.0


def _records(pid, lengths, epoch=0, cap=None):
    return [TraceRecord(pid, epoch, s, 10, L, cap is not None and L >= cap)
            for s, L in enumerate(lengths)]


def test_shrinks_toward_population_and_knows_unseen_prompts():
    hist = Trace(_records("long", [4000] * 8) + _records("short", [500] * 8)
                 + _records("mid", [1500] * 8) + _records("few", [4000]))
    pred = Predictor(hist)
    long, short, few, unseen = (pred.predict(p) for p in ("long", "short", "few", "new"))
    assert short.median < unseen.median < long.median
    # One observation moves the prediction less than eight identical ones.
    assert unseen.median < few.median < long.median
    assert not unseen.seen and long.seen
    assert unseen.sd > long.sd


def test_truncated_lengths_are_lower_bounds():
    cap = 2000
    cut = _records("cut", [cap] * 8, cap=cap)
    same = [TraceRecord("same", 0, s, 10, cap, False) for s in range(8)]
    others = _records("o1", [300] * 8) + _records("o2", [900] * 8)
    pred = Predictor(Trace(cut + same + others), cap=cap)
    assert pred.predict("cut").mu > pred.predict("same").mu
    assert pred.predict("cut").quantile(0.99) == cap


def test_empty_history_predicts_the_cap():
    pred = Predictor(Trace([]), cap=1000)
    assert pred.empty and pred.predict("x").median == pytest.approx(1000)
    assert Predictor(Trace([])).cap is None


@pytest.mark.parametrize("name, lo, hi", [("deepscaler", 0.6, 1.0), ("eurus", 0.45, 1.0),
                                          ("nosignal", -0.1, 0.1)])
def test_quality_on_synthetic_traces(name, lo, hi):
    trace = generate(preset(name), seed=2)
    for e in (2, 4):
        batch = trace.epoch(e)
        pred = Predictor.for_epoch(trace, e)
        q = score(pred.predict_batch(batch), batch)
        assert lo <= q["spearman"] <= hi, (e, q)
        # Calibrated: about half below the median, about 90% below the 0.9 quantile.
        assert abs(q["calibration"]["0.5"] - 0.5) < 0.08, q
        assert abs(q["calibration"]["0.9"] - 0.9) < 0.05, q
        assert q["mae"] > 0
    assert (pred.icc < 0.05) == (name == "nosignal")


def test_decay_is_validated():
    with pytest.raises(ValueError, match="decay"):
        Predictor(Trace([]), decay=0)
    assert math.isclose(Predictor(Trace(_records("a", [10, 20]))).predict("a").cap or 0, 0)
