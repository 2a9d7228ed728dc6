"""TransformerEngine's layer for the dense part: megatron-core's TE-spec TransformerLayer (input
RMSNorm fused into the QKV projection, TE fused attention, TEGroupedMLP experts) holds our weights
under `megatron_layer_state(spec="te")` names, and its attention computes ours within bf16
tolerance. Skipped without CUDA or TransformerEngine (in the H100 image TE must import:
docker/smoke.py). NOT YET RUN ON A GPU.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.models import Qwen3MoeModel
from megatron_rl.models.megatron_backend import transformer_engine
from megatron_rl.models.qwen3_moe import rope_cos_sin
from tests.gpu.checks.megatron_checks import CHECK_CONFIG
from tools.gpu_env import needs_cuda

pytestmark = [needs_cuda,
              pytest.mark.skipif(transformer_engine()[0] is None, reason="TransformerEngine is not installed"),
              pytest.mark.timeout(300)]
DIST_BACKEND = "nccl"  # for the one_rank_group fixture (tests/conftest.py)


def test_te_layer_holds_our_weights_and_its_attention_computes_ours(one_rank_group):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_rl.models.megatron_backend import moe_pg_collection, transformer_config
    from megatron_rl.models.megatron_weights import (
        canonical_state_dict,
        from_megatron_layer_state,
        megatron_layer_state,
    )

    torch.cuda.set_device(0)
    cfg = CHECK_CONFIG
    model = Qwen3MoeModel(cfg, dtype=torch.bfloat16)
    model.init_weights(2)
    model = model.cuda()
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=True,
                                                      qk_layernorm=True)
    config = transformer_config(cfg, ep_size=1, dispatcher="alltoall", dtype=torch.bfloat16, device="cuda")
    layer = build_module(spec, config=config, layer_number=1, pg_collection=moe_pg_collection(one_rank_group,
                                                                                              one_rank_group))
    owned = list(range(cfg.num_moe_experts))
    canon = canonical_state_dict(model)
    missing, unexpected = layer.load_state_dict(megatron_layer_state(canon, 0, owned, spec="te"), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    theirs = {k: v for k, v in layer.state_dict().items() if not k.endswith("_extra_state")}
    back = from_megatron_layer_state(theirs, 0, owned, spec="te")
    assert all(torch.equal(back[k], canon[k]) for k in back)

    B, S, C = 2, 64, cfg.kv_channels
    x = torch.randn(B, S, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(S, device="cuda").expand(B, S), C, cfg.rotary_base, torch.bfloat16, S)
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, C, 2, dtype=torch.float64) / C))
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat([ang, ang], dim=-1).float()[:, None, None, :].cuda()
    with torch.no_grad():
        ours = model.decoder.layers[0].self_attention(model.decoder.layers[0].input_layernorm(x),
                                                      cos[:, :, None, None], sin[:, :, None, None], None).float()
        te, _ = layer.self_attention(x.transpose(0, 1).contiguous(), None, rotary_pos_emb=emb)
        err = (te.transpose(0, 1).float() - ours).abs().max().item()
    scale = ours.abs().max().item()
    print(f"[TE attention] max |TE - ours| {err:.4g} (scale {scale:.3g})")
    assert err <= 3e-2 * scale
