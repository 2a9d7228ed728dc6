"""Routes recorded through an EP shrink equal a vanilla run's: `train` with the megatron backend (the
megatron-core CPU harness) on 2 and 4 gloo ranks and the torch backend on 4, `natural` floor 1 (the other
ranks leave, their experts move to rank 0; megatron-core's layers are rebuilt on the smaller group
and get new router hooks) against `vanilla`, float32, routing replay on: the same routes for every
response, and the same step (the natural run's plan is forced to shrink: `_shrinking`)."""
import pytest
import torch

from tests.helpers.train import each_policy, rank_results, trainer_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _shrinking(real):
    """The real plan with every other rank given one response and rank 0 the rest (in waves of
    `max_batch_per_rank`), and a stage where the others, drained, have left: the shrink happens."""
    from dataclasses import replace

    from elastic.planning.dims import block_owners
    from elastic.planning.plan import Stage

    def plan(items, *args, **kwargs):
        p = real(items, *args, **kwargs)
        E, W = p.num_experts, p.ranks
        assignments = [replace(a, rank=i + 1 if i < W - 1 else 0) for i, a in enumerate(p.assignments)]
        stages = [Stage(members=tuple(range(W)), drained=(), owners=block_owners(E, range(W))),
                  Stage(members=(0,), drained=tuple(range(1, W)), owners=block_owners(E, [0]))]
        return replace(p, assignments=assignments, stages=stages)
    return plan


def _measure(policy, trainer):
    from test_train_migration import _capture

    if policy == "natural":
        trainer.rollout.planner.plan = _shrinking(trainer.rollout.planner.plan)
    rollouts = _capture(trainer.rollout)
    m = trainer_step(trainer, 1)
    return {"routes": [r.routes.tolist() for r in rollouts[0].responses], "final_stage": m["final_stage"],
            "loss": m["loss"], "agreement": m["mismatch"]["router_agreement"]}


def _policies(ctx, backend: str, data: str, out: str):
    from dataclasses import replace

    from test_train_migration import _cfg

    from megatron_rl.trainer_config import ElasticConfig

    configs = {}
    for policy in ("vanilla", "natural"):
        configs[policy] = replace(_cfg("vanilla", data), backend=backend, dtype="float32", ranks=ctx.world,
                                  elastic=ElasticConfig(policy=policy, floor=1))
        configs[policy].generation.max_batch_per_rank = 4
    each_policy(ctx, out, configs, _measure)


@pytest.mark.parametrize("backend,world", [("megatron", 2), ("megatron", 4), ("torch", 4)])
def test_routes_through_a_shrink_equal_vanilla(request, backend, world, tmp_path):
    from megatron_rl.data.arith import make_problems, write_jsonl
    from megatron_rl.parallel.launch import run_ranks

    if backend == "megatron":
        request.getfixturevalue("megatron_harness")
    data = tmp_path / "arith.jsonl"
    write_jsonl(make_problems(8, seed=0, max_operand=4, ops="+"), data)
    run_ranks(_policies, world, backend, str(data), str(tmp_path), timeout_s=500.0)
    for r in rank_results(tmp_path, world):
        assert r["natural"]["final_stage"] == 1 and r["vanilla"]["final_stage"] == 0, "no shrink: proves nothing"
        assert r["natural"]["routes"] == r["vanilla"]["routes"]
        assert r["natural"]["loss"] == r["vanilla"]["loss"]
        assert torch.tensor(r["vanilla"]["routes"][0]).max() < 8
