"""megatron-core's MoELayer on 2 gloo ranks, driven as the elastic runtime drives an engine: built on
the passed EP group with each rank owning its block of the torch backend's experts, shrunk to rank 0
alone (expert moves by `Plan.transfers`, drops, rebuild on the pre-created group), then restored to
both ranks with every weight's checksum unchanged.

Construction only: megatron-core 0.16.1's router and dispatchers need CUDA for the forward pass
(tools/gpu_check.sh runs it on a GPU).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from elastic.planning.dims import block_owners
from elastic.planning.plan import Plan, Stage
from megatron_rl.errors import FlexFloorError
from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.parallel.launch import run_ranks

pytestmark = pytest.mark.timeout(240)
CPU_BUILD = {"dispatcher": "allgather", "dtype": torch.float32, "expert_module": "SequentialMLP", "device": "cpu"}


def _check(model: Qwen3MoeModel, reference: Qwen3MoeModel, group, experts: list[int]) -> None:
    from megatron_rl.models.params import is_expert_param

    if group.size() > 1:
        # megatron-core's DDP reduces a parameter over the world unless it marks it `allreduce=False`
        # (an expert, over an EP group of more than one rank); our replica check and gradient-norm
        # split go by name. Both must see the same experts.
        names = dict(model.named_parameters())
        marked = {n for n, p in names.items() if not getattr(p, "allreduce", True)}
        assert marked and marked == {n for n in names if is_expert_param(n)}
    for i, (moe, ref) in enumerate(zip(model.moe_layers, reference.moe_layers)):
        assert moe.layer.ep_group is group and moe.layer.token_dispatcher.ep_group is group
        assert moe.layer.experts.ep_group is group
        assert moe.local_experts == experts, (moe.local_experts, experts)
        assert torch.equal(moe.router_weight, ref.router.weight)
        for e, (fc1, fc2) in moe.expert_weights().items():
            want = ref.experts.get(e)
            assert torch.equal(fc1, want.linear_fc1.weight) and torch.equal(fc2, want.linear_fc2.weight), (i, e)


def _rank(ctx, mcfg: MoEModelConfig):
    from elastic.runtime.runtime import _move_experts
    from megatron_rl.rollout.elastic_engines.megatron_engine import MegatronElasticEngine
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    rank, E = ctx.rank, mcfg.num_moe_experts
    stages = [Stage(members=(0, 1), drained=(), owners=block_owners(E, [0, 1])),
              Stage(members=(0,), drained=(1,), owners=block_owners(E, [0]))]
    plan = Plan(ranks=2, floor=1, num_experts=E, layout="natural", tailguard=False, assignments=[], stages=stages)
    owners = [{e: st.owner_of(e) for e in range(E)} for st in stages]
    # Every group is created up front on every rank, as the elastic runtime pre-creates them.
    selves = [dist.new_group([r]) for r in range(ctx.world)]
    groups = [dist.group.WORLD, dist.new_group([0])]
    reference = Qwen3MoeModel(mcfg, dtype=torch.float32)
    reference.init_weights(3)

    # Stage 0: each rank holds its block, as the rollout builds it (init_weights gives every
    # expert the same weights whichever subset a rank holds).
    mine = [e for e in range(E) if stages[0].owner_of(e) == rank]
    model = Qwen3MoeModel(mcfg, mine, torch.float32)
    model.init_weights(3)
    engine = MegatronElasticEngine(RolloutEngine(model, SamplingParams(), 4, 32), ctx.world, selves[rank], **CPU_BUILD)
    before = engine.checksums()
    off_block = {e: 1 - r for e, r in owners[0].items()}
    with pytest.raises(FlexFloorError, match="expected experts in megatron-core's contiguous blocks"):
        engine.use_group(groups[0], off_block)
    engine.use_group(groups[0], owners[0])
    _check(model, reference, groups[0], mine)

    # Shrink to rank 0 alone, in the runtime's order: moves, drops, switch (members only).
    _move_experts(engine, plan.transfers(0, 1), rank)
    for e in engine.held_experts():
        if rank not in stages[1].owners[e]:
            engine.drop_expert(e)
    if rank == 0:
        engine.use_group(groups[1], owners[1])
        _check(model, reference, groups[1], list(range(E)))
    else:
        assert engine.held_experts() == []

    # Restore the full world: the experts go back, every weight as before the rollout.
    _move_experts(engine, plan.transfers(1, 0), rank)
    for e in engine.held_experts():
        if rank not in stages[0].owners[e]:
            engine.drop_expert(e)
    engine.use_group(groups[0], owners[0])
    _check(model, reference, groups[0], mine)
    assert engine.checksums() == before
    dist.barrier()
    return sorted(before)


def test_megatron_layers_follow_the_elastic_runtime_through_shrink_and_restore():
    names = run_ranks(_rank, 2, MoEModelConfig(), timeout_s=180)
    assert "decoder.layers.0.mlp.router.weight" in names and "expert.0" in names
