import math

import pytest
import torch

from megatron_rl.rl import (
    LossBatch,
    finalize_stats,
    group_advantages,
    kl_k3,
    policy_loss,
    token_logprobs,
)
from megatron_rl.trainer_config import GRPOConfig

L = math.log
G = GRPOConfig()  # clip_low = clip_high = 0.2, no KL term, no truncated importance sampling


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), group_size=2)
    s = 0.5 / math.sqrt(0.5)  # deviation 0.5 over the unbiased std of {0, 1}
    assert torch.allclose(adv, torch.tensor([s, -s, -s, s, 0.0, 0.0]), atol=1e-5)
    centred = group_advantages(torch.tensor([3.0, 1.0, 2.0]), group_size=3, std_normalize=False)
    assert torch.allclose(centred, torch.tensor([1.0, -1.0, 0.0]))
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_token_logprobs():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert torch.allclose(token_logprobs(logits, torch.tensor([1])), torch.tensor([L(0.25)]))


def test_clipped_loss_and_gradient_by_hand():
    # Token 0: ratio 0.5/0.4 = 1.25 > 1 + 0.2 with A = 2 -> clipped at 1.2, no gradient.
    # Token 1: ratio 1 -> contributes -A * ratio; d/dlogp = -A * ratio / 2 tokens = -1.
    # Token 2: padding.
    logp = torch.tensor([[L(0.5), L(0.25), L(0.9)]], requires_grad=True)
    old = torch.tensor([[L(0.4), L(0.25), L(0.1)]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, sums = policy_loss(logp, LossBatch(old, torch.tensor([2.0]), mask), G)
    assert loss.item() == pytest.approx(-(2.4 + 2.0) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -1.0, 0.0]]))
    stats = finalize_stats(sums)
    assert stats["clip_frac"] == pytest.approx(0.5) and stats["ratio_mean"] == pytest.approx(1.125)


def test_negative_advantage_clips_below():
    logp = torch.tensor([[L(0.2)]], requires_grad=True)
    loss, sums = policy_loss(logp, LossBatch(torch.tensor([[L(0.4)]]), torch.tensor([-1.0]), torch.ones(1, 1)), G)
    assert loss.item() == pytest.approx(0.8)  # -min(0.5 * -1, 0.8 * -1)
    loss.backward()
    assert logp.grad.item() == 0.0 and sums["clipped"].item() == 1.0


def test_k3_kl_and_its_term_in_the_loss():
    assert kl_k3(torch.tensor(L(0.5)), torch.tensor(L(0.25))).item() == pytest.approx(
        0.5 + math.log(2) - 1
    )
    logp = torch.tensor([[L(0.5)]])
    base, _ = policy_loss(logp, LossBatch(logp, torch.tensor([1.0]), torch.ones(1, 1)), G)
    with_kl, sums = policy_loss(
        logp, LossBatch(logp, torch.tensor([1.0]), torch.ones(1, 1), ref_logp=torch.tensor([[L(0.25)]])),
        GRPOConfig(kl_coef=0.1))
    assert (with_kl - base).item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    assert finalize_stats(sums)["kl"] == pytest.approx(0.5 + math.log(2) - 1)


def test_truncated_importance_sampling_weight():
    # old/rollout = 2 capped at 1.5 for token 0; 0.5 for token 1 (no cap below).
    logp = torch.tensor([[L(0.4), L(0.4)]])
    old = logp.clone()
    rollout = torch.tensor([[L(0.2), L(0.8)]])
    loss, sums = policy_loss(logp, LossBatch(old, torch.tensor([1.0]), torch.ones(1, 2), rollout_logp=rollout),
                             GRPOConfig(tis_cap=1.5))
    assert loss.item() == pytest.approx(-(1.5 + 0.5) / 2)
    assert finalize_stats(sums)["tis_weight_mean"] == pytest.approx(1.0)


def test_global_normalizer_makes_shards_sum_to_the_whole():
    torch.manual_seed(0)
    logp = torch.randn(4, 5, requires_grad=True)
    old, adv = logp.detach() + 0.1 * torch.randn(4, 5), torch.randn(4)
    mask = (torch.rand(4, 5) > 0.3).float()
    whole, _ = policy_loss(logp, LossBatch(old, adv, mask), G)
    parts = [policy_loss(logp[i : i + 2], LossBatch(old[i : i + 2], adv[i : i + 2], mask[i : i + 2]), G,
                         normalizer=mask.sum())[0] for i in (0, 2)]
    assert torch.allclose(whole, parts[0] + parts[1])


def test_token_entropy():
    from megatron_rl.rl.update.grpo import token_entropy

    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(token_entropy(logits), torch.tensor([math.log(4.0), 0.0]), atol=1e-6)
