"""Backend equality on a GPU: the same Qwen3-MoE weights through the `torch` backend and through
megatron-core's MoELayer (TransformerEngine grouped GEMM, alltoall dispatcher) give the same logits
within bf16 tolerance, and a zero-token step (a dummy run) passes through the layer without touching
the next step's values. Needs CUDA; tools/gpu_check.sh runs it on a lent GPU, and its dry run on CPU
through the megatron-core test harness (`megatron_device`, tests/gpu/conftest.py). Without
TransformerEngine installed it checks our GroupedMM experts (torch._grouped_mm) instead (and says so).
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from tools.gpu_env import MEGATRON_DIST_BACKEND, needs_megatron_device, sized

try:
    import transformer_engine.pytorch  # noqa: F401
    HAVE_TE = True
except ImportError:
    HAVE_TE = False

# TransformerEngine's grouped GEMM where TE imports, else our torch._grouped_mm module.
EXPERTS = "TEGroupedMLP" if HAVE_TE else "GroupedMM"
pytestmark = [needs_megatron_device, pytest.mark.timeout(300)]

DIST_BACKEND = MEGATRON_DIST_BACKEND  # for the one_rank_group fixture (tests/conftest.py)
# On the GPU as written; in the dry run (CPU, through the megatron-core harness) at tiny shapes.
CONFIG = sized(MoEModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=4, kv_channels=32,
                              num_moe_experts=16, moe_router_topk=4, moe_ffn_hidden_size=128, vocab_size=1024))


def _models(ep_group, dispatcher, device: str):
    from megatron_rl.models.megatron_backend import (
        install_megatron_moe,
        moe_pg_collection,
    )

    reference = Qwen3MoeModel(CONFIG, dtype=torch.float32)
    reference.init_weights(11)
    torch_bf16 = Qwen3MoeModel(CONFIG, dtype=torch.bfloat16)
    torch_bf16.load_state_dict(reference.state_dict())
    megatron = Qwen3MoeModel(CONFIG, dtype=torch.bfloat16)
    megatron.load_state_dict(reference.state_dict())
    reference, torch_bf16, megatron = (m.to(device).eval() for m in (reference, torch_bf16, megatron))
    install_megatron_moe(megatron, moe_pg_collection(ep_group, ep_group), dispatcher=dispatcher,
                         dtype=torch.bfloat16, expert_module=EXPERTS, device=device)
    return reference, torch_bf16, megatron


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_megatron_logits_match_the_torch_backend_within_bf16_tolerance(one_rank_group, megatron_device, dispatcher):
    reference, torch_bf16, megatron = _models(one_rank_group, dispatcher, megatron_device)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 48), generator=torch.Generator().manual_seed(0)).to(megatron_device)
    with torch.no_grad():
        ref = reference(ids).float()
        ours = torch_bf16(ids).float()
        theirs = megatron(ids).float()
    # bf16 keeps 8 bits of mantissa: the megatron path may differ from the fp32 reference by about
    # as much as the torch bf16 path does (other kernels, other summation order), not more.
    err_torch = (ours - ref).abs().max().item()
    err_megatron = (theirs - ref).abs().max().item()
    scale = ref.abs().max().item()
    experts = "TE grouped GEMM" if HAVE_TE else "GroupedMM (no TransformerEngine)"
    print(f"[{dispatcher}, {experts}] max |logit error| vs fp32: torch bf16 {err_torch:.4g}, megatron bf16 "
          f"{err_megatron:.4g} (logit scale {scale:.3g})")
    assert err_megatron <= 2 * err_torch + 1e-2 * scale
    agree = (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item()
    assert agree >= 0.95, f"greedy tokens agree on {agree:.1%} of positions"


def test_zero_tokens_pass_through_the_megatron_layer(one_rank_group, megatron_device):
    """The dummy run: a rank with no live request still steps every MoE layer with zero tokens. The
    step gives an empty bf16 output, and the same tokens through the layer before and after it give
    the same values, which are the torch backend's MoE output within bf16 tolerance (a zero-token
    step that left state behind, or a layer that computes nothing, fails here)."""
    _, torch_bf16, megatron = _models(one_rank_group, "alltoall", megatron_device)
    x = torch.randn(16, CONFIG.hidden_size, generator=torch.Generator().manual_seed(1)).to(megatron_device,
                                                                                          torch.bfloat16)
    layer, ours = megatron.moe_layers[0], torch_bf16.moe_layers[0]
    with torch.no_grad():
        before = layer(x).float()
        out = layer(x[:0])
        after = layer(x).float()
        want = ours(x).float()
    assert out.shape == (0, CONFIG.hidden_size) and out.dtype == torch.bfloat16
    assert torch.equal(after, before) and before.abs().max() > 0
    err = (before - want).abs().max().item()
    print(f"[zero-token step] megatron MoE layer vs torch backend's: max |error| {err:.4g} "
          f"(scale {want.abs().max().item():.3g})")
    assert err <= 2e-2 * want.abs().max().item()
