"""megatron-core's MoELayer on 2 gloo ranks: built on the passed EP group, each rank owning its block
of experts with the torch backend's weights, then rebuilt on a one-rank group after a shrink.

Construction only: megatron-core 0.16.1's router and dispatchers need CUDA for the forward pass
(tools/gpu_check.sh runs it on a GPU).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.parallel.launch import run_ranks

pytestmark = pytest.mark.timeout(240)
CPU_BUILD = dict(dispatcher="allgather", dtype=torch.float32, grouped_gemm=False, device="cpu")


def _expert(model: Qwen3MoeModel, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    ex = model.moe_layers[layer].experts.get(e)
    return ex.linear_fc1.weight.detach(), ex.linear_fc2.weight.detach()


def _check(moe, reference: Qwen3MoeModel, layer: int, experts: list[int]) -> None:
    assert moe.local_experts == experts, (moe.local_experts, experts)
    assert torch.equal(moe.router_weight, reference.moe_layers[layer].router.weight)
    for e, (fc1, fc2) in moe.expert_weights().items():
        ref1, ref2 = _expert(reference, layer, e)
        assert torch.equal(fc1, ref1) and torch.equal(fc2, ref2), f"layer {layer} expert {e}"


def _rank(ctx, mcfg: MoEModelConfig):
    from megatron_rl.models.megatron_backend import (
        install_megatron_moe,
        moe_pg_collection,
        rebuild_ep,
    )

    rank = ctx.rank
    # Every group is created up front on every rank, as the elastic runtime pre-creates them.
    selves = [dist.new_group([r]) for r in range(ctx.world)]
    full = dist.new_group(list(range(ctx.world)))
    floor = dist.new_group([0])
    reference = Qwen3MoeModel(mcfg, dtype=torch.float32)
    reference.init_weights(3)

    # Each rank holds only the block of experts stage 0 gives it, as the rollout builds it
    # (init_weights gives every expert the same weights whichever subset a rank holds).
    per = mcfg.num_moe_experts // ctx.world
    mine = list(range(rank * per, (rank + 1) * per))
    model = Qwen3MoeModel(mcfg, mine, torch.float32)
    model.init_weights(3)
    install_megatron_moe(model, moe_pg_collection(full, selves[rank]), **CPU_BUILD)
    for i, moe in enumerate(model.moe_layers):
        assert moe.layer.ep_group is full and moe.layer.token_dispatcher.ep_group is full
        assert moe.layer.experts.ep_group is full and moe.layer.experts.tp_group is selves[rank]
        _check(moe, reference, i, mine)

    # Shrink to rank 0 alone: it gains rank 1's experts (here read from the reference, in the
    # runtime moved by `Plan.transfers`); rank 1 leaves and builds nothing.
    if rank == 0:
        gained = [e for e in range(mcfg.num_moe_experts) if e not in mine]
        incoming = {e: [_expert(reference, i, e) for i in range(mcfg.num_layers)] for e in gained}
        rebuild_ep(model, moe_pg_collection(floor, selves[0]), incoming)
        for i, moe in enumerate(model.moe_layers):
            assert moe.layer.ep_group is floor
            _check(moe, reference, i, list(range(mcfg.num_moe_experts)))
    dist.barrier()
    return [moe.local_experts for moe in model.moe_layers]


def test_megatron_moe_layers_follow_the_passed_ep_group_and_rebuild_after_a_shrink():
    out = run_ranks(_rank, 2, MoEModelConfig(), timeout_s=180)
    assert out == [list(range(8))] * 2
