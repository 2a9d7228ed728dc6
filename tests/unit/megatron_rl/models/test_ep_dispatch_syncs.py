"""Expert-parallel dispatch reads the device once per MoE layer (the send and receive counts in one
copy), in a one-rank gloo group in-process: the same code as on NCCL, where each read is a sync.
Before the sync-free step a layer made five (bincount, two tolists, the bank's bincount and its tolist)."""
import datetime

import pytest
import torch
import torch.distributed as dist

from megatron_rl.models import MoEModelConfig
from megatron_rl.models.ep_dispatch import AllToAllDispatcher
from megatron_rl.models.moe import MoELayer

from ..rollout.test_decode_sync_free import host_reads


@pytest.fixture
def world_of_one():
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store, timeout=datetime.timedelta(seconds=30))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_one_host_read_per_moe_layer(world_of_one):
    cfg = MoEModelConfig(hidden_size=64, num_moe_experts=8, moe_router_topk=2)
    torch.manual_seed(0)
    moe = MoELayer(cfg, range(8), torch.float32)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(12, 64)
    with torch.inference_mode():
        local = moe(x[:10])  # the same rows per expert as the padded EP call's real rows
        moe.dispatcher = AllToAllDispatcher(world_of_one, [0] * 8)
        valid = torch.tensor([True] * 10 + [False] * 2)  # padding rows: the null expert, no bytes
        with host_reads() as seen:
            ep = moe(x, valid)
    assert seen == ["tolist"], seen
    assert torch.equal(ep[:10], local) and not ep[10:].any()
