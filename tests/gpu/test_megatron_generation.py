"""`backend: megatron` generates the torch backend's greedy tokens on the same bf16 weights where the
logit margin is large, and reports the agreement rate (tests/gpu/checks/megatron_checks.greedy_agreement, whose
logic tests/unit/tools/test_megatron_checks.py checks on CPU, at this margin on this model). One GPU, a
one-rank NCCL EP group; in the dry run the CPU, through the megatron-core test harness, at tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.models import Qwen3MoeModel
from tests.gpu.checks.megatron_checks import CHECK_CONFIG, GENERATION_MARGIN_STD, greedy_agreement, same_weights
from tools.gpu_env import MEGATRON_DIST_BACKEND, needs_megatron_device, sized

pytestmark = [needs_megatron_device, pytest.mark.timeout(300)]
DIST_BACKEND = MEGATRON_DIST_BACKEND  # for the one_rank_group fixture (tests/conftest.py)


def test_megatron_greedy_tokens_match_the_torch_backend_where_the_margin_is_large(one_rank_group, megatron_device):
    from megatron_rl.models.megatron_backend import (
        backend_report,
        install_megatron_moe,
        megatron_options,
        moe_pg_collection,
    )

    cfg = sized(CHECK_CONFIG)
    reference = Qwen3MoeModel(cfg, dtype=torch.float32)
    reference.init_weights(11)
    torch_bf16 = same_weights(reference, torch.bfloat16, megatron_device).eval()
    megatron = same_weights(reference, torch.bfloat16, megatron_device).eval()
    install_megatron_moe(megatron, moe_pg_collection(one_rank_group, one_rank_group),
                         **megatron_options(torch.bfloat16))
    prompts = torch.randint(1, cfg.vocab_size, (16, 12), generator=torch.Generator().manual_seed(0)).to(megatron_device)
    out = greedy_agreement(torch_bf16, megatron, prompts, steps=32, margin=GENERATION_MARGIN_STD)
    print(f"[megatron generation, {backend_report()['experts']}] greedy tokens agree with the torch "
          f"backend on {out['agreement']:.1%} of {out['steps']}; on {out['large_margin_agreement']:.1%} of the "
          f"{out['large_margin_steps']} with margin > {GENERATION_MARGIN_STD} logit std")
    assert out["ok"], out
