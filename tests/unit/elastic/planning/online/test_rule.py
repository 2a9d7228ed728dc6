"""The online re-planning rule: invariants for any arrival of finished responses, and the simulator
carrying it out."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic.planning.chains.schedule import FINE_SPAN, MAX_CANDIDATES, build_stages
from elastic.planning.layout import natural
from elastic.planning.lengths.predict import LengthDist
from elastic.planning.lengths.remaining import OnlineModel, OnlineOptions, SiblingFit
from elastic.planning.memory.kv_unit import kv_unit
from elastic.planning.online.ladder import ladder_plan
from elastic.planning.online.place import Decision, LiveState, check_decision, deal, place
from elastic.planning.online.rule import OnlineRule, RuleConfig
from elastic.planning.plan import Plan
from elastic.planning.shape import ModelShape
from elastic.sim.costmodel import CostModel
from elastic.sim.replay import Policy, simulate_trace
from elastic.sim.synth import generate, preset

E = 16
SHAPE = ModelShape(name="t", num_experts=E)
COST = CostModel(shape=SHAPE)


def _plan(ranks, floor, keys):
    base = Plan(ranks, ranks, E, "natural", False, natural(keys, ranks), build_stages([ranks], E))
    return ladder_plan(base, floor)


@pytest.mark.parametrize("ranks,floor", [(16, 1), (16, 4), (64, 4), (256, 16), (40, 3)])
def test_ladder_is_bounded_nested_and_owned(ranks, floor):
    plan = _plan(ranks, floor, [("p", i) for i in range(ranks)])
    plan.check()  # nested stages, every expert owned by a member in every stage
    bound = FINE_SPAN + 1 if ranks - floor <= FINE_SPAN else MAX_CANDIDATES + 1
    assert len(plan.stages) <= bound
    assert len(plan.stages[-1].members) == floor


def _rule(plan, prompts, samples, migrate=True, objective="occupied"):
    n = prompts * samples
    dists = [LengthDist(np.log1p(300.0 * (1 + p % 3)), 0.7, 4096, True) for p in range(prompts) for _ in range(samples)]
    model = OnlineModel(dists, [f"p{p}" for p in range(prompts) for _ in range(samples)],
                        SiblingFit(0.4, 0.0, 1.0, 50), OnlineOptions(migrate=migrate))
    return OnlineRule(plan, [100] * n, model, COST, SHAPE, RuleConfig(objective=objective, check_every=8))


@st.composite
def states(draw):
    ranks = draw(st.integers(2, 8))
    floor = draw(st.integers(1, ranks))
    prompts, samples = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    n = prompts * samples
    keys = [(f"p{p}", s) for p in range(prompts) for s in range(samples)]
    plan = _plan(ranks, floor, keys)
    stage = draw(st.integers(0, len(plan.stages) - 1))
    members = list(plan.stages[stage].members)
    done = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    tokens = np.array(draw(st.lists(st.integers(1, 4096), min_size=n, max_size=n)))
    # Live requests sit on the current members (a detached rank holds none); finished ones anywhere.
    rank_of = np.array([draw(st.sampled_from(members)) if not d else draw(st.integers(0, ranks - 1))
                        for d in done])
    step = int(draw(st.integers(0, 4096)))
    return plan, prompts, samples, stage, step, rank_of, tokens, done


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states(), st.booleans(), st.sampled_from(["occupied", "rollout"]))
def test_decisions_keep_the_invariants(state, migrate, objective):
    plan, prompts, samples, stage, step, rank_of, tokens, done = state
    rule = _rule(plan, prompts, samples, migrate, objective)
    d = rule.decide(stage, step, rank_of, tokens, done)
    check_decision(plan, stage, d, rank_of, done)  # never back up, nobody leaves with a live request
    if not migrate:
        assert not d.moves
    kept = set(plan.stages[d.stage].members)
    for i, r in d.moves:
        assert r in kept and r != rank_of[i]
    # The decision is a function of the state: every rank's rule computes the same one.
    assert _rule(plan, prompts, samples, migrate, objective).decide(stage, step, rank_of, tokens, done) == d


def test_check_decision_catches_a_stranded_request():
    keys = [("p", i) for i in range(4)]
    plan = _plan(4, 1, keys)
    rank_of, done = np.array([0, 1, 2, 3]), np.array([False, True, True, True])
    check_decision(plan, 0, Decision(3), np.array([0, 1, 2, 3]), done)  # rank 0 stays in stage 3
    with pytest.raises(ValueError, match="would leave"):
        check_decision(plan, 0, Decision(3), np.array([3, 1, 2, 0]), np.array([False, True, True, True]))
    with pytest.raises(ValueError, match="goes from stage"):
        check_decision(plan, 2, Decision(1), rank_of, done)
    with pytest.raises(ValueError, match="outside stage"):
        check_decision(plan, 0, Decision(3, ((0, 2),)), rank_of, done)


def test_adaptive_in_the_simulator():
    """On a long-tailed trace the online rule shrinks, moves stragglers, keeps the ledger, produces
    every token, and is faster than vanilla under the rollout objective."""
    trace = generate(preset("deepscaler", prompts=32, samples=8, epochs=3, cap=4096, median=500), seed=0)
    cost, shape = CostModel(), ModelShape()
    kw = dict(ranks=16, cost=cost, shape=shape, epochs=[2])
    van = simulate_trace(trace, Policy("vanilla", 16), **kw).summary()
    for objective in ("rollout", "occupied"):
        res = simulate_trace(trace, Policy("adaptive", 4, True, objective=objective), **kw)
        s = res.summary()  # Ledger.check inside
        assert s["response_tokens"] == van["response_tokens"]
        assert s["shrinks"] >= 1
        assert s["rollout_time_s"] <= van["rollout_time_s"] * 1.01
        assert s["tokens_per_occupied_rank_s"] > van["tokens_per_occupied_rank_s"]


def test_time_gained_on_vanilla_is_spent_once():
    # `LatencyGuard.bound` lets an option run longer than the fastest by what the rollout has gained on
    # vanilla so far; after a shrink the fastest remainder is itself slower, and a bound taken
    # from it must not hand out the same gain again.
    keys = [(f"p{p}", s) for p in range(4) for s in range(4)]
    rule = _rule(_plan(8, 2, keys), 4, 4)
    rule.guard.clock = {"own": 50.0, "vanilla": 60.0}  # 10 s gained
    first = rule.guard.bound(100.0)
    assert first == pytest.approx(60.0 + 101.0 - 50.0)  # margin 1% plus the 10 s
    # A shrink spent it: the next fastest remainder is 10 s longer, the clocks have not moved yet.
    assert rule.guard.bound(110.0) == pytest.approx(111.1)  # only the margin on the new fastest
    assert rule.guard.bound(110.0) < 60.0 + 110.0 * 1.01 - 50.0
    # Without a gain the bound is the margin alone.
    fresh = _rule(_plan(8, 2, keys), 4, 4)
    assert fresh.guard.bound(100.0) == pytest.approx(101.0)


def test_rebalance_evens_a_group_across_nodes():
    # 16 ranks span two nodes (8 per node); rank 0 holds most of the long, live requests. The rule
    # stays (floor 16: nowhere to shrink to) and moves some of them to the idle members.
    ranks, prompts, samples = 16, 16, 4
    keys = [(f"p{p}", s) for p in range(prompts) for s in range(samples)]
    plan = _plan(ranks, ranks, keys)
    rule = _rule(plan, prompts, samples, objective="rollout")
    n = prompts * samples
    rank_of = np.array([0 if i < 32 else 1 + i % 15 for i in range(n)])
    tokens, done = np.full(n, 200), np.zeros(n, bool)
    done[32:] = np.arange(n - 32) % 2 == 0  # the other ranks have half their requests finished
    d = rule.decide(0, 64, rank_of, tokens, done)
    assert d.stage == 0 and d.moves
    assert {rank_of[i] for i, _ in d.moves} == {0}
    assert any(r >= 8 for _, r in d.moves)  # across the node boundary


def test_shrinks_are_priced_with_the_leaving_requests_dealt_to_members():
    # `targets.shrink_targets` deals the leaving ranks' requests (`place.deal`: longest expected
    # remainder first, snake order over the members, least loaded first), so a large shrink is
    # priced at its busiest member rather than at an even spread.
    keys = [(f"p{p}", s) for p in range(4) for s in range(2)]
    plan = _plan(4, 2, keys)
    j = len(plan.stages) - 1
    kept = list(plan.stages[j].members)
    ranks = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    rem = np.array([[10.0, 20.0, 400.0, 300.0, 30.0, 40.0, 200.0, 100.0]])
    out = deal(plan, j, ranks, rem)
    assert set(out) <= set(kept)
    assert (out[np.isin(ranks, kept)] == ranks[np.isin(ranks, kept)]).all()  # members keep theirs
    load = {r: rem[0][out == r].sum() for r in kept}
    assert max(load.values()) <= rem[0].sum() / 2 + 100  # the two long ones went to different members
    assert out[2] != out[3]


@pytest.mark.parametrize("kv,fits", [(kv_unit("tokens"), True), (kv_unit("paged", 16), True),
                                     (kv_unit("paged", 256), False), (kv_unit("slots"), False)])
def test_a_move_is_checked_in_the_receivers_positions_slots_or_pages(kv, fits):
    # Two requests of 100 prompt + 100 tokens + up to 100 more, one on the rank that stays, one on
    # the rank that leaves, and 700 positions of room: 2 x 300 tokens fit, as do 2 x 304 in pages of
    # 16; 2 x 512 in pages of 256 or 2 slots of 4,196 do not.
    plan = _plan(2, 1, [("p", 0), ("p", 1)])
    stay = plan.stages[-1].members[0]
    rank_of = np.array([stay, 1 - stay])
    live, prompt, tokens, rem = np.arange(2), np.full(2, 100.0), np.full(2, 100.0), np.full((4, 2), 100.0)
    moves = place(plan, len(plan.stages) - 1, LiveState(live, rank_of, tokens, rem), {stay: 700}, prompt, None,
                  lambda positions, more: kv.held(positions, more, 4196))
    assert moves == ([(1, stay)] if fits else None)

