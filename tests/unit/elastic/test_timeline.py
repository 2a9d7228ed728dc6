"""Per-rank timelines (elastic/timeline.py): the recorder, conservation of the ledger, the simulator's
timelines and the figure."""
import pytest

from elastic.ledger import Ledger, RankLedger
from elastic.planning.shape import ModelShape
from elastic.sim.costmodel import DEFAULT_COST
from elastic.sim.replay import Policy, simulate_trace
from elastic.sim.simulate import SimConfig
from elastic.sim.synth import generate, preset
from elastic.timeline import RankTimeline, Timeline


def _two_ranks() -> Ledger:
    a, b = RankLedger(0), RankLedger(1)
    for _ in range(3):
        a.add("busy", 0.1)
    a.add("transition", 0.05)
    a.mark("stage", "stage 1: 1 ranks")
    a.add("busy", 0.2, 2)
    b.add("busy", 0.1)
    b.add("dummy", 0.2, 2)
    b.add("transition", 0.05)
    b.mark("stage", "stage 1: 1 ranks")
    b.add("leased", 0.15, 1)
    b.add("idle", 0.05, 1)
    a.lead("dummy", 0.01)
    b.add("idle", 0.01, 0)
    return Ledger([a, b], wall_s=0.56, total_steps=6)


def test_segments_merge_runs_and_sit_on_one_clock():
    ledger = _two_ranks()
    ledger.check()
    tl = Timeline.of_ledger(ledger, pools=[{}, {"leases": [{"job": "rewards", "seconds": 0.15, "ended": "finished"}]}])
    tl.check(ledger)
    a = [(s.state, round(s.start_s, 6), round(s.seconds, 6), s.steps) for s in tl.segments if s.rank == 0]
    assert a == [("dummy", 0.0, 0.01, 0), ("busy", 0.01, 0.3, 3), ("transition", 0.31, 0.05, 1), ("busy", 0.36, 0.2, 2)]
    marks = [(m.rank, m.kind, round(m.at_s, 6), m.label) for m in tl.marks]
    # rank 0's mark moved with its lead; rank 1's lease starts where it detached
    assert marks == [(0, "stage", 0.36, "stage 1: 1 ranks"), (1, "stage", 0.35, "stage 1: 1 ranks"),
                     (1, "lease-start", 0.35, "rewards"), (1, "lease-end", 0.5, "finished")]
    assert tl.columns()[:2] == ["rank", "state"] and len(tl.rows()) == len(tl.segments)


def test_check_catches_a_segment_the_ledger_does_not_have():
    ledger = _two_ranks()
    ledger.ranks[1].timeline.add("busy", 0.01)  # recorded, never booked
    with pytest.raises(AssertionError, match="rank 1 busy segments sum to"):
        Timeline.of_ledger(ledger).check(ledger)
    ledger = _two_ranks()
    ledger.ranks[0].seconds["busy"] += 1e-6  # booked, never recorded
    with pytest.raises(AssertionError, match="rank 0 busy"):
        Timeline.of_ledger(ledger).check(ledger)


def test_round_trip_through_a_report():
    ledger = _two_ranks()
    again = RankLedger.from_dict(ledger.ranks[1].to_dict())
    assert again.timeline.to_dict() == ledger.ranks[1].timeline.to_dict()
    with pytest.raises(ValueError, match="unknown timeline mark"):
        RankTimeline().mark("nap")


@pytest.mark.parametrize("policy,ranks,floor,lease,migrate", [
    ("planned", 8, 2, True, 2), ("adaptive", 16, 4, True, 0), ("vanilla", 8, 8, False, 0)])
def test_simulated_timelines_conserve_the_ledger(policy, ranks, floor, lease, migrate):
    trace = generate(preset("deepscaler", prompts=16, samples=4, epochs=2, cap=4096), seed=3)
    res = simulate_trace(trace, Policy(policy, floor, True), ranks=ranks, cost=DEFAULT_COST, shape=ModelShape(),
                         config=SimConfig(check_every=8, lease=lease, migrate_max=migrate, timeline=True))
    for r in res.rollouts:
        tl = Timeline.of_ledger(r.ledger)
        tl.check(r.ledger)
        kinds = {m.kind for m in tl.marks}
        if r.transitions:
            assert "stage" in kinds
            assert ("lease-start" in kinds) == (lease and r.ledger.rank_seconds()["leased"] > 0)
        if r.migrated:
            assert "migrate" in kinds
    if policy != "vanilla":
        assert any(r.transitions for r in res.rollouts), "nothing shrank: the test proves little"
    if policy == "adaptive":
        assert any(r.migrated for r in res.rollouts), "nothing moved: the test proves little"


def test_the_figure_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from elastic.timeline_plot import plot_timelines

    tl = Timeline.of_ledger(_two_ranks(), title="two ranks")
    path = plot_timelines([tl, tl], tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
