"""Expert-parallel GRPO gradients on 2 and 4 gloo ranks equal one process's on the same batch."""
import random

import pytest
import torch

from megatron_rl.parallel.launch import run_ranks
from megatron_rl.rl.rollout_phase.phase import Response
from megatron_rl.trainer_config import GRPOConfig, OptimConfig, TrainerConfig
from tests.helpers.train import trainer_config

pytestmark = pytest.mark.timeout(240)


def _cfg(ranks: int) -> TrainerConfig:
    return trainer_config(
        grpo=GRPOConfig(group_size=4, micro_batch=3, kl_coef=0.1, tis_cap=2.0),
        optim=OptimConfig(lr=1e-12, grad_clip=0.0),
        prompts_per_step=4, ranks=ranks, dtype="float64")


def _batch():
    rng = random.Random(3)
    responses = []
    for i in range(16):
        prompt = [1] + [rng.randrange(3, 24) for _ in range(rng.randrange(2, 6))]
        tokens = [rng.randrange(3, 24) for _ in range(rng.randrange(1, 7))]
        responses.append(Response(i, f"p{i // 4}", i % 4, prompt, tokens,
                                  [-rng.uniform(0.5, 3.0) for _ in tokens], False))
    advantages = torch.tensor([rng.uniform(-1.5, 1.5) for _ in range(16)], dtype=torch.float64)
    return responses, advantages


def _grads(ctx, ranks):
    import torch.distributed as dist

    from megatron_rl.backends import backend
    from megatron_rl.rl.update.policy_update import PolicyUpdate
    from megatron_rl.rl.update.train_step import frozen_copy, make_optimizer

    cfg = _cfg(ranks)
    model = backend(cfg.backend).training_model(cfg, ctx.rank, ctx.world)
    ref = frozen_copy(model)
    with torch.no_grad():  # a reference that differs from the policy, so the KL term has a gradient
        for p in ref.parameters():
            p.add_(0.01)
    update = PolicyUpdate(cfg, model, make_optimizer(model, 1e-12), ref, 0, ctx.rank, ctx.world)
    responses, advantages = _batch()
    recomputed = update.recompute_logprobs(update.minibatches(responses, advantages))
    # Perturb the old log-probs so some ratios leave the clip range; the perturbation depends on
    # the row (through its advantage) and the position only, not on how rows are packed.
    for batch in recomputed.batches:
        for mb in batch.micro:
            S = mb.old_logp.shape[1]
            mb.old_logp = mb.old_logp + 0.3 * torch.sin(7 * mb.advantages[:, None] + torch.arange(S)[None])
    stats = update.update(recomputed)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    every = [None] * ctx.world
    dist.all_gather_object(every, grads)
    merged = {}
    for g in every:
        for n, t in g.items():
            if ".local_experts." in n or n not in merged:
                merged[n] = t
    # numpy, not tensors: torch's queue would pass tensors as shared memory owned by the rank process
    return {n: t.numpy() for n, t in merged.items()}, stats


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_grads, 1, 1, timeout_s=120)


@pytest.mark.parametrize("ranks", [2, 4])
def test_ep_gradients_match_single_process(reference, ranks):
    ref_grads, ref_stats = reference
    grads, stats = run_ranks(_grads, ranks, ranks, timeout_s=120)
    assert set(grads) == set(ref_grads)
    worst = max(float(abs(grads[n] - ref_grads[n]).max()) for n in grads)
    print(f"{ranks} ranks: largest gradient difference {worst:.2e}")
    assert worst < 1e-5, worst
    # the experts do get gradient (through the all-to-all backward), not only the dense weights
    assert any(float(abs(g).max()) > 1e-7 for n, g in grads.items() if ".local_experts." in n)
    assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-9)
    assert stats["loss"] == pytest.approx(ref_stats["loss"], rel=1e-9)
    # entropy (float32, like the log-probs) is summed over each rank's tokens, then divided by the global count
    assert stats["entropy"] == pytest.approx(ref_stats["entropy"], rel=1e-6) and stats["entropy"] > 0
    assert 0 < stats["clip_frac"] < 1 and stats["kl"] > 0
