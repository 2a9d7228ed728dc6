"""The GPU path's CPU-testable parts on 2 gloo ranks: the host-staged transport gives the direct
one's tokens and gradients, warmed stage groups leave no communicator for a shrink to create, and a
detached rank reports the memory it freed."""
import pytest
import torch

from megatron_rl.config import load_dataclass
from megatron_rl.parallel.launch import run_ranks
from megatron_rl.rollout.config import RolloutConfig

pytestmark = pytest.mark.timeout(300)

BASE = {"batch.prompts": 4, "batch.samples": 2, "batch.length_scale": 0.01, "ranks": 2, "timeout_s": 60.0}


def config(**o):
    return load_dataclass(RolloutConfig, None, {**BASE, **o})


def _instrumented_rollout(ctx, job, warm: bool) -> list[str]:
    """Run `job` with fresh stage groups; return the order of group creations ('new_group'),
    first collectives on a stage group ('first') and barriers (the first ends the runtime's setup)."""
    import torch.distributed as dist

    import elastic.runtime.runtime as rt
    from elastic.runtime import groups, transport
    from megatron_rl.rollout_runner import rank_jobs

    events, seen = [], set()
    real_new_group, real_barrier, real_warm = dist.new_group, dist.barrier, rt.warm_groups

    class Recording(transport.HostStagedTransport):
        def _first(self, group):
            if group is not None and group is not dist.group.WORLD and id(group) not in seen:
                seen.add(id(group))
                events.append("first")

        def all_reduce(self, t, group=None):
            self._first(group)
            return super().all_reduce(t, group)

        def all_to_all(self, x, out_splits, in_splits, group):
            self._first(group)
            return super().all_to_all(x, out_splits, in_splits, group)

    groups._cache["world"] = None  # fresh stage groups
    dist.new_group = lambda *a, **k: events.append("new_group") or real_new_group(*a, **k)
    dist.barrier = lambda *a, **k: events.append("barrier") or real_barrier(*a, **k)
    transport.TRANSPORTS["host"] = Recording
    rt.warm_groups = real_warm if warm else (lambda *a, **k: None)
    try:
        rank_jobs(ctx, [job], True)
    finally:
        dist.new_group, dist.barrier, rt.warm_groups = real_new_group, real_barrier, real_warm
        transport.TRANSPORTS["host"] = transport.HostStagedTransport
    return events


def _dispatch_grads(ctx, transport_name: str):
    """Forward and backward through the EP all-to-all; this rank's input and expert gradients."""
    import torch.distributed as dist

    from elastic.runtime.transport import make_transport
    from megatron_rl.models.config import MoEModelConfig
    from megatron_rl.models.ep_dispatch import AllToAllDispatcher
    from megatron_rl.models.moe import MoELayer

    cfg = MoEModelConfig()
    layer = MoELayer(cfg, [e for e in range(8) if e // 4 == ctx.rank], torch.float32)
    gen = torch.Generator().manual_seed(ctx.rank)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    layer.dispatcher = AllToAllDispatcher(dist.group.WORLD, [e // 4 for e in range(8)], make_transport(transport_name))
    x = torch.randn(5 + ctx.rank, cfg.hidden_size, generator=gen, requires_grad=True)
    layer(x).square().sum().backward()
    return [x.grad] + [p.grad for p in layer.experts.parameters()]


def _rank(ctx, jobs, warm_job):
    from megatron_rl.rollout_runner import rank_jobs

    cold = _instrumented_rollout(ctx, warm_job, warm=False)
    warm = _instrumented_rollout(ctx, warm_job, warm=True)
    grads = {name: _dispatch_grads(ctx, name) for name in ("direct", "host")}
    same_grads = all(torch.equal(a, b) for a, b in zip(grads["direct"], grads["host"]))
    flags = torch.tensor([int(same_grads)])
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    reports = [r.report for r in rank_jobs(ctx, jobs, True)] if ctx.rank == 0 else rank_jobs(ctx, jobs, True)
    return cold, warm, bool(flags), reports


def test_host_staged_equals_direct_and_warm_groups_leave_nothing_to_create():
    from megatron_rl.rollout_runner import prepare

    natural = dict(policy="natural", floor=1, **{"sampling.greedy": False, "sampling.top_p": 0.9})
    jobs = [prepare(config(policy="vanilla", **{"sampling.greedy": False, "sampling.top_p": 0.9})),
            prepare(config(**natural, transport="host")), prepare(config(**natural))]
    cold, warm, same_grads, (vanilla, host, direct) = run_ranks(
        _rank, 2, jobs, prepare(config(**natural, transport="host")), timeout_s=120)
    # Rank 0 stays in the 1-rank floor stage. Without warm-up its first collective on that group
    # comes after setup, mid-rollout (on NCCL: a communicator created during a shrink); with it,
    # every group is created and used before the barrier that starts the clock.
    setup_end = warm.index("barrier")
    assert warm.count("new_group") == 1 and warm.index("new_group") < setup_end
    assert "first" in warm and all(i < setup_end for i, e in enumerate(warm) if e == "first")
    assert any(e == "first" for e in cold[cold.index("barrier"):])
    assert same_grads, "host-staged all-to-all gradients differ from the direct ones"
    assert host["final_stage"] == direct["final_stage"] == 1 and host["transport"] == "host"
    assert host["responses_sha256"] == direct["responses_sha256"] == vanilla["responses_sha256"]
    # Rank 1 detached: its KV cache (64 slots) and its 4 experts' weights, freed for leases.
    assert host["freed_bytes"] == direct["freed_bytes"]
    freed = host["freed_bytes"]["1"]
    assert freed["experts"] == 4 * 2 * (2 * 32 * 64 + 64 * 32) * 8 and freed["kv_cache"] > 0
    assert vanilla["freed_bytes"] == {}
