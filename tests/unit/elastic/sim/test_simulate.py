"""The simulator core over hand-built plans (the planner's plans are tested in test_simtrace.py)."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.planning.dims import block_owners
from elastic.planning.layout import natural
from elastic.planning.plan import Plan, Stage, static_plan
from elastic.sim.costmodel import DEFAULT_COST
from elastic.sim.simulate import SimConfig, lower_bound_s, simulate_rollout
from elastic.trace import TraceRecord

E = 128


def tailed_batch(prompts=32, samples=4, cap=4096, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for p in range(prompts):
        mu = rng.normal(np.log(cap / 6), 0.8)
        for s in range(samples):
            n = int(min(cap, max(1, np.exp(rng.normal(mu, 0.3)))))
            out.append(TraceRecord(f"p{p:03d}", 1, s, int(rng.integers(20, 200)), n, n >= cap))
    return out


def halving_plan(batch, ranks, floor):
    """natural placement; each stage keeps the half of the group that drains last (an oracle
    chain, built by hand so these tests do not depend on the planner)."""
    asg = natural([r.key for r in batch], ranks)
    rank_of = {(a.prompt_id, a.sample): a.rank for a in asg}
    drain = np.zeros(ranks)
    for r in batch:
        drain[rank_of[r.key]] = max(drain[rank_of[r.key]], r.response_len)
    order = [int(x) for x in np.argsort(-drain, kind="stable")]
    stages = [Stage(tuple(range(ranks)), (), block_owners(E, range(ranks)))]
    g = ranks
    while g // 2 >= floor:
        g //= 2
        keep = tuple(sorted(order[:g]))
        stages.append(Stage(keep, tuple(sorted(set(stages[-1].members) - set(keep))), block_owners(E, keep)))
    return Plan(ranks, floor, E, "natural", False, asg, stages)


def vanilla(batch, ranks):
    return static_plan("natural", natural([r.key for r in batch], ranks), ranks, E)


@pytest.mark.parametrize("lease", [False, True])
@pytest.mark.parametrize("migrate", [0, 1])
@pytest.mark.parametrize("ranks,floor", [(16, 16), (16, 2), (8, 1), (4, 2)])
def test_ledger_conserves_rank_time(ranks, floor, lease, migrate):
    batch = tailed_batch()
    plan = vanilla(batch, ranks) if floor == ranks else halving_plan(batch, ranks, floor)
    res = simulate_rollout(plan, batch, DEFAULT_COST, config=SimConfig(lease=lease, migrate_max=migrate))
    led = res.ledger
    led.check(seconds_tolerance=1e-9)
    for r in led.ranks:
        assert sum(r.steps.values()) == led.total_steps
        assert sum(r.seconds.values()) == pytest.approx(led.wall_s, rel=1e-9)
    assert res.response_tokens == sum(r.response_len for r in batch)
    assert led.wall_s >= res.lower_bound_s
    if not lease:
        assert led.rank_seconds()["leased"] == 0


def test_vanilla_dummy_steps_are_exactly_the_wait_for_the_last_rank():
    batch = tailed_batch(seed=3)
    res = simulate_rollout(vanilla(batch, 8), batch, DEFAULT_COST)
    plan = vanilla(batch, 8)
    rank_of = plan.rank_of()
    longest = max(r.response_len for r in batch)
    drain = [max([r.response_len for r in batch if rank_of[r.key] == k], default=0) for k in range(8)]
    for k, rl in enumerate(res.ledger.ranks):
        # the prefill tick emits the first token, then drain - 1 busy decode steps, the rest dummy.
        assert rl.steps["dummy"] == longest - drain[k]
        assert rl.steps["busy"] == drain[k]
    assert res.ledger.total_steps == longest and res.transitions == []


def test_shrinks_happen_on_check_steps_and_detached_ranks_go_idle_or_leased():
    batch = tailed_batch(seed=1)
    plan = halving_plan(batch, 8, 2)
    k = 32
    res = simulate_rollout(plan, batch, DEFAULT_COST, config=SimConfig(check_every=k))
    shrinks = [t for t in res.transitions if t[2] != 0]
    assert shrinks and all(step % k == 0 for step, *_ in shrinks)
    restore = res.transitions[-1]
    assert restore[2] == 0
    secs = res.ledger.rank_seconds()
    assert secs["idle"] > 0 and secs["leased"] == 0 and secs["transition"] > 0
    leased = simulate_rollout(plan, batch, DEFAULT_COST, config=SimConfig(check_every=k, lease=True, lease_start_s=0))
    assert leased.ledger.rank_seconds()["leased"] == pytest.approx(secs["idle"])
    # Shrinking shortens the rollout here: the tail decodes in a group inside one node.
    van = simulate_rollout(vanilla(batch, 8), batch, DEFAULT_COST)
    assert res.ledger.rank_seconds()["dummy"] < van.ledger.rank_seconds()["dummy"]


def test_a_leaving_rank_that_outlives_its_prediction_holds_the_stage():
    # Residents 0 and 1 decode 1000 steps; 2 and 3 were planned to drain by step 100.
    batch = [TraceRecord(f"p{i}", 1, 0, 10, 1000 if i < 2 else 100) for i in range(4)]
    asg = natural([r.key for r in batch], 4)
    stages = [Stage((0, 1, 2, 3), (), block_owners(E, range(4))),
              Stage((0, 1), (2, 3), block_owners(E, (0, 1)))]
    plan = Plan(4, 2, E, "planned", True, asg, stages)
    cfg = SimConfig(check_every=8)
    on_time = simulate_rollout(plan, batch, DEFAULT_COST, config=cfg)
    assert [t[0] for t in on_time.transitions] == [104, 999]
    # Rank 3's response runs 400 steps: the shrink waits for it (it stays busy, it is never cut).
    late = simulate_rollout(plan, batch[:3] + [dataclasses.replace(batch[3], response_len=400)], DEFAULT_COST,
                            config=cfg)
    assert [t[0] for t in late.transitions] == [400, 999]
    assert late.ledger.ranks[3].steps["busy"] == 400 and late.ledger.ranks[2].steps["dummy"] == 301


def test_migration_moves_stragglers_to_residents_and_reports_it():
    batch = [TraceRecord(f"p{i}", 1, 0, 10, 200 if i != 3 else 2000) for i in range(4)]
    batch.append(TraceRecord("p9", 1, 0, 10, 3000))
    asg = [natural([r.key for r in batch[:4]], 4)[i] for i in range(4)]
    asg.append(type(asg[0])("p9", 0, 0))
    stages = [Stage((0, 1, 2, 3), (), block_owners(E, range(4))),
              Stage((0, 1), (2, 3), block_owners(E, (0, 1)))]
    plan = Plan(4, 2, E, "planned", True, asg, stages)
    plain = simulate_rollout(plan, batch, DEFAULT_COST, config=SimConfig(check_every=16))
    moved = simulate_rollout(plan, batch, DEFAULT_COST, config=SimConfig(check_every=16, migrate_max=1))
    assert plain.migrated == 0 and moved.migrated == 1 and moved.migrated_kv_bytes > 0
    assert moved.transitions[0][0] == 208 and plain.transitions[0][0] == 2000
    assert moved.ledger.rank_seconds()["dummy"] < plain.ledger.rank_seconds()["dummy"]
    moved.ledger.check()


def test_moves_between_distinct_pairs_run_at_once():
    # KV moves are booked like expert moves: the busiest sender or receiver sets the time, each
    # move over the link between its two ranks (intra-node 0-7, inter-node beyond).
    from elastic.planning.shape import ModelShape
    from elastic.sim.simulate import _Rollout

    batch = [TraceRecord(f"p{i}", 1, 0, 100, 500) for i in range(32)]
    plan = vanilla(batch, 16)  # responses 2r and 2r + 1 on rank r
    one = (100 + 10) * ModelShape().kv_bytes_per_token / DEFAULT_COST.transfer_intra_bytes_per_s

    def seconds(moves):  # (response, destination rank)
        run = _Rollout(plan, batch, DEFAULT_COST, ModelShape(), SimConfig())
        for i, dst in moves:
            run.at.move(i, dst, 10)
        return run._moved(moves, 10)

    assert seconds([(0, 1), (4, 3)]) == pytest.approx(one)  # ranks 0->1 and 2->3 at once
    assert seconds([(0, 1), (1, 2)]) == pytest.approx(2 * one)  # rank 0 sends both
    assert seconds([(0, 2), (2, 2)]) == pytest.approx(2 * one)  # rank 2 receives both
    inter = one * DEFAULT_COST.transfer_intra_bytes_per_s / DEFAULT_COST.transfer_inter_bytes_per_s
    assert seconds([(0, 1), (4, 9)]) == pytest.approx(inter)  # the cross-node move is the slower


def test_plan_and_cost_model_must_agree_on_experts():
    batch = tailed_batch(prompts=4)
    plan = static_plan("natural", natural([r.key for r in batch], 4), 4, 64)
    with pytest.raises(ValueError, match="64 experts"):
        simulate_rollout(plan, batch, DEFAULT_COST)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 600), min_size=1, max_size=40),
       ranks=st.sampled_from([1, 2, 4, 8, 16]), floor_div=st.sampled_from([1, 2, 4]),
       k=st.integers(1, 40), migrate=st.integers(0, 2))
def test_no_policy_beats_the_lower_bound(lengths, ranks, floor_div, k, migrate):
    batch = [TraceRecord(f"p{i}", 1, 0, 5 + i % 7, n) for i, n in enumerate(lengths)]
    floor = max(1, ranks // floor_div)
    plan = vanilla(batch, ranks) if floor == ranks else halving_plan(batch, ranks, floor)
    res = simulate_rollout(plan, batch, DEFAULT_COST, config=SimConfig(check_every=k, migrate_max=migrate))
    res.ledger.check(seconds_tolerance=1e-9)
    assert res.ledger.wall_s >= res.lower_bound_s * (1 - 1e-12)
    assert res.lower_bound_s == pytest.approx(lower_bound_s([r.prompt_len for r in batch],
                                                            [r.response_len for r in batch],
                                                            DEFAULT_COST, floor, ranks))


def test_fit_to_ledgers_recovers_the_scale_of_each_step_part():
    from elastic.sim.calibrate import fit_to_ledgers

    batch = tailed_batch(seed=5)
    cfg = SimConfig(check_every=4)
    truth = dataclasses.replace(DEFAULT_COST, step_overhead_s=3 * DEFAULT_COST.step_overhead_s,
                                hbm_bytes_per_s=DEFAULT_COST.hbm_bytes_per_s / 0.5,
                                flops_per_s=DEFAULT_COST.flops_per_s / 0.5,
                                a2a_intra_latency_s=2 * DEFAULT_COST.a2a_intra_latency_s,
                                a2a_inter_latency_s=tuple((e, 2 * s) for e, s in DEFAULT_COST.a2a_inter_latency_s),
                                a2a_intra_bytes_per_s=DEFAULT_COST.a2a_intra_bytes_per_s / 2,
                                a2a_inter_bytes_per_s=DEFAULT_COST.a2a_inter_bytes_per_s / 2)
    runs = []
    for plan in (vanilla(batch, 16), vanilla(batch, 4), halving_plan(batch, 16, 2)):
        measured = simulate_rollout(plan, batch, truth, config=cfg).ledger.rank_seconds()
        runs.append((plan, batch, measured))
    fitted, factors = fit_to_ledgers(runs, DEFAULT_COST, cfg)
    assert factors == pytest.approx({"overhead": 3.0, "compute": 0.5, "a2a": 2.0}, rel=1e-3)
    again = simulate_rollout(runs[2][0], batch, fitted, config=cfg).ledger.rank_seconds()
    assert again == pytest.approx(runs[2][2], rel=1e-3)


def test_whole_step_fit_on_static_runs_predicts_a_shrinking_plan():
    # One group size cannot tell overhead from all-to-all; a single factor for the whole step
    # keeps the model's shape, so a machine uniformly slower in its steps is predicted exactly.
    from elastic.sim.calibrate import WHOLE_STEP, fit_to_ledgers

    batch = tailed_batch(seed=6)
    cfg = SimConfig(check_every=4)
    slow = DEFAULT_COST.scaled(1.7)
    truth = dataclasses.replace(slow, shrink_fixed_s=DEFAULT_COST.shrink_fixed_s,
                                transfer_intra_bytes_per_s=DEFAULT_COST.transfer_intra_bytes_per_s,
                                transfer_inter_bytes_per_s=DEFAULT_COST.transfer_inter_bytes_per_s)
    static = vanilla(batch, 16)
    measured = simulate_rollout(static, batch, truth, config=cfg).ledger.rank_seconds()
    fitted, factors = fit_to_ledgers([(static, batch, measured)], DEFAULT_COST, cfg, WHOLE_STEP)
    assert factors == pytest.approx({"overhead+compute+a2a": 1.7}, rel=1e-6)
    shrinking = halving_plan(batch, 16, 2)
    want = simulate_rollout(shrinking, batch, truth, config=cfg).ledger.rank_seconds()
    assert simulate_rollout(shrinking, batch, fitted, config=cfg).ledger.rank_seconds() == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="disjoint"):
        fit_to_ledgers([(static, batch, measured)], DEFAULT_COST, cfg, (("overhead",), ("overhead", "a2a")))
