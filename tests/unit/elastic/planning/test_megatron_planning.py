"""The megatron backend's planner restriction, seen the same way by the plan, the simulator and the
runtime: every stage is megatron-core's contiguous expert blocks (`block_owners`) over a group size
that divides the expert count (ownership `blocks`)."""
from __future__ import annotations

import json

import pytest
import torch

from elastic.planning.chains.schedule import build_stages, candidate_sizes, chains
from elastic.planning.choices import PlanChoices
from elastic.planning.dims import LayoutError, ParallelDims, block_owners, planned_dims
from elastic.planning.plan import Plan, PlanError
from elastic.planning.planner import make_plan
from elastic.planning.platform import Platform
from elastic.planning.shape import ModelShape
from elastic.sim.costmodel import CostModel
from elastic.sim.replay import Policy, simulate_trace
from megatron_rl.errors import FlexFloorError
from tests.helpers.traces import small_deepscaler

QWEN = ModelShape()  # 128 experts


@pytest.fixture(scope="module")
def trace():
    return small_deepscaler()


def _assert_blocks(plan: Plan) -> None:
    assert plan.ownership == "blocks"
    for st in plan.stages:
        assert plan.num_experts % len(st.members) == 0, st.members
        assert st.owners == block_owners(plan.num_experts, st.members)


def test_block_candidates_are_the_divisors_of_the_expert_count():
    assert candidate_sizes(ParallelDims(16, 128, "blocks", even=False), 4) == [8, 4]
    assert candidate_sizes(ParallelDims(16, 128, "blocks", even=False), 3) == [8, 4]
    assert candidate_sizes(ParallelDims(16, 128, "blocks", even=False), 5) == [8]
    assert candidate_sizes(ParallelDims(12, 12, "blocks", even=False), 2) == [6, 4, 3, 2]
    # Nobody may leave: vanilla's one stage.
    assert candidate_sizes(ParallelDims(16, 128, "blocks", even=False), 9) == []
    assert candidate_sizes(ParallelDims(16, 128, even=False), 4) == list(range(15, 3, -1))  # balanced: every size
    # Past MAX_CANDIDATES the halving ladder keeps the smallest divisor above the floor.
    assert candidate_sizes(ParallelDims(256, 256, "blocks", even=False), 3) == [128, 64, 32, 16, 8, 4]
    assert all(256 % g == 0 for c in chains(ParallelDims(256, 256, "blocks", even=False), 3) for g in c)


def test_block_stages_are_block_owners_of_their_members():
    order = [3, 1, 0, 2, 5, 4, 7, 6]
    stages = build_stages([8, 4, 2], 16, order, ownership="blocks")
    assert [st.members for st in stages] == [tuple(range(8)), (0, 1, 2, 3), (1, 3)]
    for st in stages:
        assert st.owners == block_owners(16, st.members)
    balanced = build_stages([8, 4, 2], 16, order)
    assert balanced[1].owners != stages[1].owners  # the fewest-moves shrink keeps survivors' experts


@pytest.mark.parametrize("layout", ["natural", "planned"])
def test_plan_with_blocks_passes_only_through_divisor_sizes(trace, layout):
    ep = trace.epochs[-1]
    plan = make_plan(trace.epoch(ep), trace.before(ep),
                     platform=Platform(planned_dims(16, QWEN.num_experts, "blocks"), QWEN),
                     choices=PlanChoices(3, True), layout=layout)
    _assert_blocks(plan)
    # The whole search ran over divisor sizes (8, 4): 2**2 chains priced, not 2**13.
    assert plan.meta["chains_priced"] == 4
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back.ownership == "blocks"
    back.check()


def test_plan_check_refuses_a_blocks_plan_off_the_blocks(trace):
    ep = trace.epochs[-1]
    plan = make_plan(trace.epoch(ep), trace.before(ep), platform=Platform(planned_dims(8, QWEN.num_experts), QWEN),
                     choices=PlanChoices(4, False), layout="planned")
    plan.stages = build_stages([8, 4], 128)  # fewest-moves owners: the survivors keep their blocks
    plan.check()
    plan.ownership = "blocks"
    with pytest.raises(ValueError, match="stage 1: experts are not megatron-core's contiguous blocks"):
        plan.check()
    plan.ownership = "random"
    with pytest.raises(ValueError, match="ownership: expected one of balanced, blocks"):
        plan.check()


def test_blocks_refused_where_ranks_do_not_divide_the_experts_and_a_layout_of_another_model(trace):
    # The layout refuses itself when it is built, once per command; the planner refuses a layout
    # built for another model's experts.
    with pytest.raises(LayoutError, match="128 experts do not divide over 12 ranks"):
        planned_dims(12, QWEN.num_experts, "blocks")
    ep = trace.epochs[-1]
    with pytest.raises(PlanError, match=f"dims: expected the 128 experts of {QWEN.name}, got 64"):
        make_plan(trace.epoch(ep), trace.before(ep),
                  platform=Platform(planned_dims(8, ModelShape(num_experts=64).num_experts), QWEN),
                  choices=PlanChoices(4, False), layout="planned")


def test_simulator_plans_blocks_and_pays_their_moves(trace):
    runs = {o: simulate_trace(trace, Policy("planned", 4, True, ownership=o), ranks=16, cost=CostModel(),
                              shape=QWEN) for o in ("balanced", "blocks")}
    for plan in runs["blocks"].plans:
        _assert_blocks(plan)
    summary = runs["blocks"].summary()
    assert summary["ownership"] == "blocks" and summary["label"].endswith("[blocks]")
    assert runs["balanced"].summary()["ownership"] == "balanced"


def test_block_shrinks_move_more_experts_than_the_fewest_moves_shrink():
    # 16 -> 8 ranks: survivor r's block goes from [8r, 8r+8) to [16r, 16r+16), so only rank 0 keeps
    # its first 8 experts (120 moves); the fewest-moves shrink sends only the leaving ranks' 64. The simulator
    # and the planner price a shrink by these counts (Plan.transfers).
    def moves(ownership):
        stages = build_stages([16, 8, 4], 128, ownership=ownership)
        plan = Plan(16, 4, 128, "natural", False, [], stages, ownership=ownership)
        plan.check()
        return [len(plan.transfers(0, 1)), len(plan.transfers(1, 2)), len(plan.transfers(2, 0))]

    # Balanced: only the leaving ranks' experts move; the restore returns all but survivors' own 32.
    assert moves("balanced") == [64, 64, 96]
    # Blocks: only rank 0 keeps part of its block at each step (8 of 16, 16 of 32, 8 on restore).
    assert moves("blocks") == [120, 112, 120]


def test_runtime_refuses_plans_megatron_cannot_hold(trace):
    from elastic.planning.policies import policy_kind
    from megatron_rl.models import MoEModelConfig
    from megatron_rl.rollout.elastic_engines.megatron_engine import check_plan
    from megatron_rl.rollout.memory import memory_budget
    from megatron_rl.rollout.rollout_plan import RolloutPlanner, run_cost

    ep = trace.epochs[-1]
    mcfg = MoEModelConfig(num_moe_experts=12)
    budget = memory_budget(mcfg, 4, torch.device("cpu"), 6)
    shape = mcfg.shape(4, budget, ranks_per_node=6)

    def plan(dims):
        planner = RolloutPlanner(policy_kind("planned"), dims, 1, False, budget, shape, run_cost(shape, "cpu"),
                                 check_every=1, max_batch=64, max_response_len=4096)
        return planner.plan(trace.epoch(ep), trace.before(ep))

    plan_blocks = plan(ParallelDims(6, 12, "blocks"))
    check_plan(plan_blocks)
    _assert_blocks(plan_blocks)
    balanced = plan(ParallelDims(6, 12))
    with pytest.raises(FlexFloorError, match="expected a plan owning experts in megatron-core's contiguous blocks"):
        check_plan(balanced)
    balanced.ownership = "blocks"
    balanced.stages = build_stages([6, 5], 12)  # 5 ranks cannot hold 12 experts in equal blocks
    with pytest.raises(FlexFloorError, match="backend 'megatron': stage 1: experts are not megatron-core's"):
        check_plan(balanced)
