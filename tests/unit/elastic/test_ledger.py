import pytest

from elastic.ledger import Ledger, RankLedger, format_report


def test_conservation_and_summary():
    a, b = RankLedger(0), RankLedger(1)
    a.add("busy", 3.0, 3)
    b.add("busy", 1.0, 1)
    b.add("dummy", 2.0, 2)
    led = Ledger([a, b], wall_s=3.0, total_steps=3)
    led.check()
    s = led.summary(response_tokens=40)
    assert s["rank_seconds"]["dummy"] == 2.0
    assert s["dummy_share"] == pytest.approx(2 / 6)
    assert s["tokens_per_occupied_rank_s"] == pytest.approx(40 / 6)
    assert "dummy" in format_report(s)


def test_conservation_catches_missing_steps():
    a = RankLedger(0)
    a.add("busy", 1.0, 2)
    with pytest.raises(AssertionError, match="rank 0 accounts 2 steps"):
        Ledger([a], wall_s=1.0, total_steps=3).check()


def test_conservation_catches_missing_seconds():
    a = RankLedger(0)
    a.add("busy", 0.5, 1)
    with pytest.raises(AssertionError, match="rank-seconds accounted"):
        Ledger([a], wall_s=1.0, total_steps=1).check()


def test_unknown_state_rejected():
    with pytest.raises(ValueError, match="unknown ledger state"):
        RankLedger(0).add("sleeping", 1.0)
