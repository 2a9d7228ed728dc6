"""Training through megatron-core's MoE layer on one GPU: the GRPO loss's gradients match the torch
backend's within bf16 tolerance (both against an fp32 reference), and 5 GRPO steps with megatron-core's
DDP + DistributedOptimizer (fp32 masters) lower the loss (tests/gpu/checks/megatron_checks.py; its comparison
logic runs on CPU in tests/unit/tools/test_megatron_checks.py). NOT YET RUN ON A GPU; the dry run runs it on CPU
through the megatron-core test harness, at tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.models import Qwen3MoeModel
from megatron_rl.trainer_config import OptimConfig
from tests.gpu.checks.megatron_checks import CHECK_CONFIG, grad_agreement, grpo_batch, loss_falls, same_weights
from tools.gpu_env import MEGATRON_DIST_BACKEND, needs_megatron_device, sized

pytestmark = [needs_megatron_device, pytest.mark.timeout(300)]
DIST_BACKEND = MEGATRON_DIST_BACKEND  # for the one_rank_group fixture (tests/conftest.py)


def _megatron(reference, device: str):
    from megatron_rl.models.megatron_backend import install_megatron_moe, megatron_options
    from megatron_rl.rl.optim.megatron_train import training_groups

    model = same_weights(reference, torch.bfloat16, device)
    install_megatron_moe(model, training_groups(0, 1), **megatron_options(torch.bfloat16))
    return model


def test_megatron_grads_match_the_torch_backend_and_five_steps_lower_the_loss(one_rank_group, megatron_device):
    from megatron_rl.rl.optim.megatron_train import MegatronOptimizer, training_groups

    cfg, device = sized(CHECK_CONFIG), megatron_device
    reference = Qwen3MoeModel(cfg, dtype=torch.float32)
    reference.init_weights(5)
    packed, adv = grpo_batch(cfg, rows=8, prompt_len=16, response_len=48, seed=0, device=device)
    grads = grad_agreement(reference.to(device), same_weights(reference, torch.bfloat16, device),
                           _megatron(reference, device), packed, adv)
    print(f"[megatron grads] {grads['params']} parameters, worst error {grads['worst_relative_error']:.3g} of "
          f"the fp32 gradient's scale; outside tolerance: {grads['outside_tolerance']}")
    assert grads["ok"], grads

    model = _megatron(reference, device)
    opt = MegatronOptimizer(model, cfg, OptimConfig(lr=1e-4), torch.bfloat16, training_groups(0, 1))
    falls = loss_falls(model, packed, adv, opt.zero_grad, opt.finish_step, steps=5)
    print("[megatron GRPO] loss over 5 steps: " + " -> ".join(f"{x:+.4f}" for x in falls["losses"]))
    assert falls["ok"], falls
