"""The comparison logic of the megatron backend's GPU checks (tests/gpu/checks/megatron_checks.py), run on CPU
between torch-backend models: each check passes on equal models and fails on different ones."""
from __future__ import annotations

import torch

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from tests.gpu.checks.megatron_checks import grad_agreement, greedy_agreement, grpo_batch, loss_falls, same_weights

CFG = MoEModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                     num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, vocab_size=96,
                     init_method_std=0.2)


def _reference(seed=3) -> Qwen3MoeModel:
    model = Qwen3MoeModel(CFG, dtype=torch.float64)
    model.init_weights(seed)
    return model


def test_greedy_agreement_holds_for_the_same_weights_and_fails_for_others():
    ref = _reference()
    prompts = torch.randint(1, CFG.vocab_size, (4, 5), generator=torch.Generator().manual_seed(0))
    same = greedy_agreement(ref, same_weights(ref, torch.float32, "cpu"), prompts, steps=6, margin=1e-3)
    assert same["ok"] and same["agreement"] == 1.0 and same["steps"] == 24 and same["large_margin_steps"] > 0
    other = greedy_agreement(ref, _reference(seed=4), prompts, steps=6, margin=1e-3)
    assert not other["ok"] and other["agreement"] < 0.5


def test_grad_agreement_compares_every_parameter_and_sees_a_wrong_one():
    ref = _reference()
    packed, adv = grpo_batch(CFG, rows=4, prompt_len=3, response_len=4, seed=1, device="cpu")
    a, b = same_weights(ref, torch.float32, "cpu"), same_weights(ref, torch.float32, "cpu")
    out = grad_agreement(ref, a, b, packed, adv)
    assert out["ok"] and out["compared"] and out["params"] == len(dict(ref.named_parameters()))
    with torch.no_grad():
        b.decoder.layers[1].mlp.experts.get(5).linear_fc2.weight.mul_(1.5)
    bad = grad_agreement(ref, a, b, packed, adv)
    assert not bad["ok"] and bad["outside_tolerance"]


def test_loss_falls_under_adam_and_not_without_steps():
    model = same_weights(_reference(), torch.float32, "cpu")
    packed, adv = grpo_batch(CFG, rows=4, prompt_len=3, response_len=4, seed=1, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = loss_falls(model, packed, adv, opt.zero_grad, opt.step)
    assert out["ok"] and len(out["losses"]) == 6
    still = loss_falls(model, packed, adv, opt.zero_grad, lambda: None)
    assert not still["ok"]


def test_grad_agreement_reads_the_grouped_experts_gradients(megatron_harness, one_rank_group):
    """megatron-core's MoE with our GroupedMM experts (megatron's experts without TransformerEngine)
    on CPU through the harness: an expert weight is a view of the stacked parameter, with no grad of
    its own. The check once read those as zeros: every expert "differed" by its whole scale."""
    from megatron_rl.models.megatron_backend import install_megatron_moe
    from megatron_rl.rl.optim.megatron_train import training_groups

    ref = _reference()
    megatron = same_weights(ref, torch.float32, "cpu")
    install_megatron_moe(megatron, training_groups(0, 1), dispatcher="alltoall", dtype=torch.float32,
                         expert_module="GroupedMM", device="cpu")
    packed, adv = grpo_batch(CFG, rows=4, prompt_len=5, response_len=7, seed=1, device="cpu")
    out = grad_agreement(ref, same_weights(ref, torch.float32, "cpu"), megatron, packed, adv)
    assert out["ok"] and out["worst_relative_error"] < 1e-3, out
