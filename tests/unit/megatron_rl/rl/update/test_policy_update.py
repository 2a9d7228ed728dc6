"""The update phases hand their results on by name: `recompute_logprobs` returns the old-policy
log-probs and the mismatch tally of the minibatches it was given (leaving them as they were), and
`update` reports the mismatch of the `Recomputed` it is handed, whatever was recomputed since."""
import random

import torch

from megatron_rl.backends import backend
from megatron_rl.rl.rollout_phase.phase import Response
from megatron_rl.rl.update.policy_update import PolicyUpdate
from megatron_rl.rl.update.train_step import make_optimizer
from megatron_rl.trainer_config import GRPOConfig, OptimConfig
from tests.helpers.train import trainer_config


def _responses(seed: int) -> list[Response]:
    """8 responses (2 prompts x 4 samples) whose recorded sampling log-probs depend on `seed`."""
    rng, responses = random.Random(seed), []
    for i in range(8):
        prompt = [1] + [rng.randrange(3, 24) for _ in range(3)]
        tokens = [rng.randrange(3, 24) for _ in range(rng.randrange(1, 5))]
        responses.append(Response(i, f"p{i // 4}", i % 4, prompt, tokens, [-rng.uniform(0.5, 3.0) for _ in tokens],
                                  False))
    return responses


def test_update_reports_the_mismatch_it_is_handed(one_rank_group):
    cfg = trainer_config(grpo=GRPOConfig(group_size=4, micro_batch=3, tis_cap=2.0),
                         optim=OptimConfig(lr=1e-12), prompts_per_step=2, ranks=1, dtype="float64")
    model = backend(cfg.backend).training_model(cfg, 0, 1)
    update = PolicyUpdate(cfg, model, make_optimizer(model, 1e-12), None, 0, 0, 1)
    advantages = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64)
    batches = update.minibatches(_responses(1), advantages)
    first = update.recompute_logprobs(batches)
    assert all(mb.old_logp is None for batch in batches for mb in batch.micro)  # its input is left alone
    assert [len(b.micro) for b in first.batches] == [len(b.micro) for b in batches] == [3]
    assert all(mb.old_logp.shape == mb.packed.loss_mask.shape for b in first.batches for mb in b.micro)
    expected = first.mismatch.finish(1)
    later = update.recompute_logprobs(update.minibatches(_responses(2), advantages))
    assert later.mismatch.finish(1)["k3_kl"] != expected["k3_kl"], "the two batches measure alike: no test"
    stats = update.update(first)
    assert {k: stats["mismatch"][k] for k in expected} == expected
    assert stats["rollout_gap"] == stats["mismatch"]["logp_abs_diff_mean"] > 0
