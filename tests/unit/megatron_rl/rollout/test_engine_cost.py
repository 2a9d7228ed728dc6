"""CPU rollouts are planned on the CPU engine's measured costs, so `planned --floor 1` shrinks on a
long-tailed trace at --length-scale 1 (it never did with the H100 cost model), and says why when
it keeps every rank."""
import torch

from elastic.planning.dims import ParallelDims
from elastic.planning.policies import policy_kind
from elastic.sim.synth import generate, preset
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.rollout.memory import memory_budget
from megatron_rl.rollout.rollout_plan import RolloutPlanner, run_cost, say_plan_notes


def _trace():
    # What `make_trace.py --preset deepscaler --prompts 16 --samples 4 --epochs 3 --median 12
    # --cap 96` writes: the README's tiny long-tailed trace, lengths a CPU rollout decodes as is.
    return generate(preset("deepscaler", prompts=16, samples=4, epochs=3, median=12, cap=96), seed=0)


def _plan(trace, **cost):
    """`planned` floor 1 on 4 CPU ranks, its chains priced by `run_cost(**cost)`."""
    mcfg = MoEModelConfig()
    budget = memory_budget(mcfg, 8, torch.device("cpu"), 4)
    shape = mcfg.shape(8, budget, ranks_per_node=4)
    planner = RolloutPlanner(policy_kind("planned"), ParallelDims(4, mcfg.num_moe_experts), 1, False, budget, shape,
                             cost=run_cost(shape, "cpu", **cost), check_every=1,
                             max_batch=64)
    return planner.plan(trace.epoch(2), trace.before(2))


def test_planned_floor1_shrinks_on_the_cpu_engine(capsys):
    plan = _plan(_trace(), length_scale=1.0)
    assert len(plan.stages) > 1 and len(plan.stages[-1].members) < 4
    assert "every rank stays" not in capsys.readouterr().err


def test_a_plan_that_keeps_every_rank_says_why(capsys):
    plan = _plan(_trace(), shrink_cost_s=0.05)  # the H100 model's shrink: nothing pays on this model
    assert len(plan.stages) == 1
    assert "every rank stays" not in capsys.readouterr().err  # the caller says it, once per run
    say_plan_notes(plan)
    err = capsys.readouterr().err
    assert err.startswith("[plan] planned floor 1: every rank stays") and "chains priced" in err


def test_an_adaptive_rule_prices_a_shrink_as_its_plan_does():
    """One price of a shrink per run: with `shrink_cost_s` the online rule priced a shrink at this
    engine's measured 10 ms while the plan priced it at the setting, so the plan's shrinks were
    cancelled by the rule at its first check, every rollout."""
    mcfg = MoEModelConfig()
    budget = memory_budget(mcfg, 8, torch.device("cpu"), 4)
    shape = mcfg.shape(8, budget, ranks_per_node=4)
    for cost in ({}, {"shrink_cost_s": 1e-6}):
        planner = RolloutPlanner(policy_kind("adaptive"), ParallelDims(4, mcfg.num_moe_experts), 1, False, budget,
                                 shape, cost=run_cost(shape, "cpu", **cost), check_every=1, max_batch=64)
        trace = _trace()
        setup = planner.setup(trace.epoch(2), trace.before(2))
        assert len(setup.plan.stages) > 1 and setup.rule is not None
        assert setup.rule.cost == planner.cost and planner.cost.shrink_s(0, 4) == cost.get("shrink_cost_s", 0.010)


def test_an_adaptive_plan_that_keeps_every_rank_is_vanillas():
    """The vanilla path is vanilla's plan (its layout and owners), not the planned layout of a chain
    where nobody leaves (which cost 5-7% more rollout time on the tiny example); the meta says why."""
    mcfg = MoEModelConfig()
    budget = memory_budget(mcfg, 8, torch.device("cpu"), 4)
    shape = mcfg.shape(8, budget, ranks_per_node=4)
    dims, trace = ParallelDims(4, mcfg.num_moe_experts), _trace()

    def setup(policy):
        kind = policy_kind(policy)
        planner = RolloutPlanner(kind, dims, kind.floor(4, 1), False, budget, shape,
                                 cost=run_cost(shape, "cpu", shrink_cost_s=0.05), check_every=1, max_batch=64)
        return planner.setup(trace.epoch(2), trace.before(2))

    adaptive, vanilla = setup("adaptive"), setup("vanilla")
    assert adaptive.rule is None and len(adaptive.plan.stages) == 1
    assert adaptive.plan.assignments == vanilla.plan.assignments and adaptive.plan.stages == vanilla.plan.stages
    assert "every rank stays (the vanilla path)" in adaptive.plan.meta["every_rank_stays"]
    assert adaptive.plan.meta["effective_layout"] == adaptive.plan.layout == "natural"  # as its metrics say
