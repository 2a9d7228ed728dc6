"""Quorum schedules: ownership, candidate chains, and the chain the planner picks."""
import json
import math

import numpy as np
import pytest

from elastic.planning.chains.estimate import replay
from elastic.planning.chains.schedule import (
    build_stages,
    candidate_sizes,
    chains,
    contiguous_owners,
    held_counts,
    shrink_owners,
)
from elastic.planning.choices import PlanChoices
from elastic.planning.dims import ParallelDims, block_owners, planned_dims
from elastic.planning.plan import Assignment, Plan, PlanError
from elastic.planning.planner import FixedCost, ShapeCost, make_plan, plan_epoch
from elastic.planning.platform import Platform
from elastic.planning.shape import ModelShape
from elastic.sim.synth import generate, preset

QWEN = ModelShape()


def test_contiguous_owners_is_block_owners_when_it_divides():
    assert contiguous_owners(128, range(16)) == block_owners(128, range(16))
    uneven = contiguous_owners(10, range(4))
    assert sorted(held_counts(uneven, range(4)).values()) == [2, 2, 3, 3]
    replicas = contiguous_owners(4, range(10))
    assert all(len(rs) >= 2 for rs in replicas.values())
    assert set(held_counts(replicas, range(10)).values()) == {1}


@pytest.mark.parametrize("E, W, g", [(128, 16, 8), (128, 16, 3), (12, 8, 5), (4, 10, 3), (6, 6, 1)])
def test_shrink_moves_only_orphans_and_stays_balanced(E, W, g):
    before = contiguous_owners(E, range(W))
    after = shrink_owners(before, range(g))
    survivors = set(range(g))
    orphans = [e for e, rs in before.items() if not set(rs) & survivors]
    moved = [e for e, rs in after.items() if not set(rs) <= set(before[e])]
    assert sorted(moved) == orphans  # fewest moves: only experts nobody left holds
    for e, rs in after.items():
        assert rs and set(rs) <= survivors
        # A survivor keeps an expert it held unless it dropped a spare replica.
        for _r in set(before[e]) & survivors - set(rs):
            assert len(rs) >= 1 and len(before[e]) > 1
    held = held_counts(after, range(g))
    assert max(held.values()) <= math.ceil(E / g) + (1 if E < W else 0)


def test_candidate_sizes_and_chains():
    # Small worlds may shed ranks one by one; large ones use divisors of E, then a halving ladder.
    assert candidate_sizes(ParallelDims(16, 128, even=False), 2) == list(range(15, 1, -1))
    assert candidate_sizes(ParallelDims(16, 128, even=False), 16) == []
    assert candidate_sizes(ParallelDims(64, 128, even=False), 3) == [32, 16, 8, 4, 3]
    # 32 and 16 hold even replicas of 8.
    assert candidate_sizes(ParallelDims(64, 8, even=False), 4) == [32, 16, 8, 4]
    big = candidate_sizes(ParallelDims(256, 256, even=False), 1)
    assert 1 in big and len(big) <= 6 and big == sorted(big, reverse=True)
    assert list(chains(ParallelDims(4, 128, even=False), 2)) == [[4], [4, 3], [4, 2], [4, 3, 2]]
    for c in chains(ParallelDims(256, 64, even=False), 3):
        assert c[0] == 256 and all(a > b for a, b in zip(c, c[1:])) and c[-1] >= 3


def test_stages_and_the_shrink_trigger():
    stages = build_stages([8, 4, 2], 16, order=[5, 1, 0, 7, 2, 3, 4, 6])
    plan = Plan(8, 2, 16, "natural", False, [], stages)
    plan.check()
    assert stages[0].owners == block_owners(16, range(8))
    assert stages[1].members == (0, 1, 5, 7) and stages[1].drained == (2, 3, 4, 6)
    assert stages[2].members == (1, 5) and stages[2].drained == (0, 7)
    assert plan.advance(0, {2, 3, 4}) == 0
    assert plan.advance(0, {2, 3, 4, 6, 0}) == 1
    assert plan.advance(0, {0, 2, 3, 4, 6, 7}) == 2
    # Only the leaving ranks' experts move.
    assert {src for _, src, _ in plan.transfers(0, 1)} == {2, 3, 4, 6}


def test_floor_equal_to_ranks_is_one_stage():
    trace = generate(preset("eurus", prompts=16), seed=0)
    for layout in ("natural", "lengthsort", "planned"):
        plan = plan_epoch(trace, 2, platform=Platform(planned_dims(4, QWEN.num_experts), QWEN),
                          choices=PlanChoices(4, False), layout=layout)
        assert len(plan.stages) == 1 and plan.predicted_release_rank_s == 0
    vanilla = plan_epoch(trace, 2, platform=Platform(planned_dims(4, QWEN.num_experts), QWEN),
                         choices=PlanChoices(4, False), layout="natural")
    batch = trace.epoch(2)
    assert [a.rank for a in vanilla.assignments] == [i * 4 // len(batch) for i in range(len(batch))]


class _Cost:
    """A caller's cost model: the planner must follow it, not its own default."""

    def __init__(self, shrink_s, small_group_speedup):
        self._shrink, self._speedup = shrink_s, small_group_speedup

    def decode_step_s(self, batch_per_rank, context, ep_size):
        return 0.01 * (self._speedup ** -math.log2(16 / ep_size))

    def shrink_s(self, experts_moved, ep_size):
        return self._shrink


def test_chain_follows_the_callers_cost_model():
    trace = generate(preset("deepscaler"), seed=0)
    dims, kw = planned_dims(16, QWEN.num_experts), dict(choices=PlanChoices(2, True), layout="planned")
    costly = plan_epoch(trace, 3, platform=Platform(dims, QWEN, _Cost(shrink_s=1e4, small_group_speedup=1.0)), **kw)
    assert len(costly.stages) == 1
    fast_small = plan_epoch(trace, 3, platform=Platform(dims, QWEN, _Cost(shrink_s=0.0, small_group_speedup=1.5)),
                            **kw)
    assert len(fast_small.stages) >= 3
    assert fast_small.meta["predicted_rollout_s"] < fast_small.meta["predicted_static_rollout_s"]


def test_objective_trades_release_for_rollout_time():
    trace = generate(preset("deepscaler"), seed=0)
    kw = dict(platform=Platform(planned_dims(16, QWEN.num_experts), QWEN), layout="planned")
    capacity = plan_epoch(trace, 3, choices=PlanChoices(4, True), **kw)
    latency = plan_epoch(trace, 3, choices=PlanChoices(4, True, objective="rollout"), **kw)
    assert latency.meta["predicted_rollout_s"] <= capacity.meta["predicted_rollout_s"]
    assert capacity.meta["predicted_occupied_rank_s"] <= latency.meta["predicted_occupied_rank_s"]
    with pytest.raises(PlanError, match="objective: expected one of"):
        plan_epoch(trace, 3, choices=PlanChoices(4, True, objective="fast"), **kw)


def test_tiny_cpu_model_shrinks_under_a_fixed_cost():
    """The runtime's CPU models: H100 figures make a 50 ms shrink dearer than a whole rollout of
    64 tokens, so nobody leaves; a measured fixed step cost lets the plan shrink."""
    tiny = ModelShape(name="cpu-tiny", num_experts=8, topk=2, num_layers=2, hidden_size=64,
                      expert_ffn=32, bytes_per_param=4, kv_bytes_per_token=512, dense_bytes=0,
                      memory_per_rank_bytes=2**30)
    trace = generate(preset("deepscaler", prompts=8, samples=2, epochs=3, cap=64, median=12), seed=0)
    dims, kw = planned_dims(4, tiny.num_experts), dict(choices=PlanChoices(1, True), layout="planned")
    assert len(plan_epoch(trace, 2, platform=Platform(dims, tiny), **kw).stages) == 1
    plan = plan_epoch(trace, 2, platform=Platform(dims, tiny, FixedCost(step_s=0.01, shrink_fixed_s=0.02)), **kw)
    assert len(plan.stages) >= 2 and plan.predicted_release_rank_s > 0
    plan.check([r.key for r in trace.epoch(2)])


@pytest.mark.parametrize("shrink, T, detached", [(0.0, 100.0, 90.0), (5.0, 105.0, 90.0)])
def test_release_estimate_by_hand(shrink, T, detached):
    """Two ranks, one response each (10 and 100 tokens), 1 s per step: rank 1 drains at step 10,
    leaves after the shrink, and is detached until the end."""
    lengths = {("short", 0): 10, ("long", 0): 100}
    plan = Plan(2, 1, 4, "planned", False,
                [Assignment("long", 0, 0), Assignment("short", 0, 1)],
                build_stages([2, 1], 4))
    est = replay(plan, lengths, 0.0, FixedCost(step_s=1.0, shrink_fixed_s=shrink))
    assert est.rollout_s == pytest.approx(T)
    assert est.static_s == pytest.approx(100.0)
    assert est.detached_rank_s == pytest.approx(detached)
    assert est.occupied_rank_s == pytest.approx(2 * T - detached)


def _replay(plan, batch):
    return replay(plan, {r.key: r.response_len for r in batch},
                  float(np.mean([r.prompt_len for r in batch])), ShapeCost(QWEN))


def test_planned_beats_vanilla_and_oracle_beats_planned_on_a_persistent_trace():
    trace = generate(preset("deepscaler"), seed=1)
    batch = trace.epoch(4)
    kw = dict(platform=Platform(planned_dims(16, QWEN.num_experts), QWEN))
    vanilla = _replay(plan_epoch(trace, 4, choices=PlanChoices(16, False), layout="natural", **kw), batch)
    planned = _replay(plan_epoch(trace, 4, choices=PlanChoices(4, True), layout="planned", **kw), batch)
    oracle = _replay(plan_epoch(trace, 4, choices=PlanChoices(4, False), layout="planned", oracle=True,
                                **kw), batch)
    assert planned.occupied_rank_s < 0.85 * vanilla.occupied_rank_s
    assert planned.detached_rank_s > 0
    assert oracle.occupied_rank_s <= planned.occupied_rank_s


def test_no_signal_degrades_to_no_worse_than_lengthsort():
    trace = generate(preset("nosignal"), seed=0)
    kw = dict(platform=Platform(planned_dims(16, QWEN.num_experts), QWEN))
    for e in (2, 5):
        batch = trace.epoch(e)
        planned_plan = plan_epoch(trace, e, choices=PlanChoices(4, True), layout="planned", **kw)
        assert planned_plan.meta["predictor"]["weak"] and "fallback" in planned_plan.meta
        planned = _replay(planned_plan, batch)
        ls = _replay(plan_epoch(trace, e, choices=PlanChoices(16, True), layout="lengthsort", **kw), batch)
        assert planned.rollout_s <= 1.02 * ls.rollout_s
        assert planned.occupied_rank_s <= 1.02 * ls.occupied_rank_s


def test_plan_round_trips_through_json():
    trace = generate(preset("eurus", prompts=24), seed=3)
    plan = plan_epoch(trace, 3, platform=Platform(planned_dims(8, QWEN.num_experts), QWEN),
                      choices=PlanChoices(2, True), layout="planned")
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back.assignments == plan.assignments and back.stages == plan.stages
    assert back.meta["chain"] == [len(s.members) for s in plan.stages]


def test_make_plan_reads_only_keys_and_prompt_lengths():
    class Item:
        def __init__(self, pid, s):
            self.prompt_id, self.sample, self.prompt_len = pid, s, 50

    trace = generate(preset("eurus", prompts=8), seed=0)
    batch = [Item(f"eurus-{i}", s) for i in range(8) for s in range(8)]
    shape = ModelShape(num_experts=8, topk=2)
    plan = make_plan(batch, trace, platform=Platform(planned_dims(4, shape.num_experts), shape),
                     choices=PlanChoices(1, True), layout="planned")
    assert len(plan.assignments) == 64
