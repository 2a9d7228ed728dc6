"""One set of weights for both MoE backends, on CPU: torch -> megatron -> torch with equal
checksums both ways, HuggingFace checkpoints into and out of either backend, and megatron-core's
own TransformerLayer (built on CPU) holding our dense and MoE weights under its names, its attention
computing what ours does.

megatron-core's router and dispatchers, and its local core attention (a CUDA scratch buffer), need
CUDA; here its SelfAttention runs with a plain SDPA core attention, which leaves the weight layout
(fused per-group QKV, q/k RMSNorm, RoPE, output projection) to megatron-core's code. The
TransformerEngine spec's layer is built and loaded on a GPU (tests/gpu/test_megatron_te.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel, load_hf_checkpoint, save_hf_checkpoint
from megatron_rl.models.megatron_backend import (
    install_megatron_moe,
    moe_pg_collection,
    transformer_config,
    uninstall_megatron_moe,
)
from megatron_rl.models.megatron_weights import (
    canonical_state_dict,
    from_megatron_layer_state,
    megatron_layer_state,
    state_digests,
)
from megatron_rl.models.qwen3_moe import rope_cos_sin

CPU_BUILD = dict(dispatcher="allgather", dtype=torch.float32, expert_module="SequentialMLP", device="cpu")
CFG = MoEModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                     num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, vocab_size=96)


def _model(seed=5) -> Qwen3MoeModel:
    model = Qwen3MoeModel(CFG, dtype=torch.float32)
    model.init_weights(seed)
    return model


def test_weights_go_torch_to_megatron_to_torch_with_equal_checksums(one_rank_group):
    model = _model()
    torch_digests = state_digests(model.state_dict())
    install_megatron_moe(model, moe_pg_collection(one_rank_group, one_rank_group), **CPU_BUILD)
    assert any(".mlp.layer." in k for k in model.state_dict())  # megatron-core's modules hold them now
    assert state_digests(canonical_state_dict(model)) == torch_digests
    uninstall_megatron_moe(model)
    assert state_digests(model.state_dict()) == torch_digests
    with pytest.raises(TypeError, match="runs MoELayer, not MegatronMoE"):
        uninstall_megatron_moe(model)


def test_hf_checkpoints_load_into_and_export_from_either_backend(tmp_path, one_rank_group):
    from safetensors.torch import load_file

    save_hf_checkpoint(_model(), tmp_path / "from_torch")
    loaded = load_hf_checkpoint(tmp_path / "from_torch", torch.float32)
    install_megatron_moe(loaded, moe_pg_collection(one_rank_group, one_rank_group), **CPU_BUILD)
    save_hf_checkpoint(loaded, tmp_path / "from_megatron")
    a = load_file(tmp_path / "from_torch" / "model.safetensors")
    b = load_file(tmp_path / "from_megatron" / "model.safetensors")
    assert sorted(a) == sorted(b) and "model.layers.1.mlp.experts.7.down_proj.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    back = load_hf_checkpoint(tmp_path / "from_megatron", torch.float32)
    assert state_digests(back.state_dict()) == state_digests(_model().state_dict())


def _local_layer(group, layer_number: int = 1):
    """megatron-core's GPT TransformerLayer (local spec, RMSNorm, q/k norm, MoE) on CPU, with an
    SDPA core attention in place of the local one, whose scratch buffer is a CUDA tensor."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gpt_layer_local_spec(num_experts=CFG.num_moe_experts, qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    config = transformer_config(CFG, ep_size=group.size(), **CPU_BUILD)
    return build_module(spec, config=config, layer_number=layer_number,
                        pg_collection=moe_pg_collection(group, group))


class SDPACoreAttention(nn.Module):
    """Causal GQA attention [S, B, H, C] x [S, B, G, C] -> [S, B, H*C], megatron-core's core
    attention interface."""

    def __init__(self, *, config, **_):
        super().__init__()

    def forward(self, q_SBHC, k_SBGC, v_SBGC, attention_mask, /, **_):
        S, B, H, C = q_SBHC.shape
        out_BHSC = F.scaled_dot_product_attention(q_SBHC.permute(1, 2, 0, 3), k_SBGC.permute(1, 2, 0, 3),
                                                  v_SBGC.permute(1, 2, 0, 3), is_causal=True, enable_gqa=True)
        return out_BHSC.permute(2, 0, 1, 3).reshape(S, B, H * C)


def test_megatron_layer_holds_our_weights_under_its_names(one_rank_group):
    model = _model()
    canon = canonical_state_dict(model)
    owned = list(range(CFG.num_moe_experts))
    for i in range(CFG.num_layers):
        layer = _local_layer(one_rank_group, i + 1)
        layer.load_state_dict(megatron_layer_state(canon, i, owned), strict=True)
        theirs = {k: v for k, v in layer.state_dict().items() if not k.endswith("_extra_state")}
        back = from_megatron_layer_state(theirs, i, owned)
        mine = {k: v for k, v in canon.items() if k.startswith(f"decoder.layers.{i}.")}
        assert sorted(back) == sorted(mine)
        assert all(torch.equal(back[k], mine[k]) for k in mine)


def test_megatron_attention_computes_ours_from_the_same_weights(one_rank_group):
    model = _model()
    layer = _local_layer(one_rank_group)
    layer.load_state_dict(megatron_layer_state(canonical_state_dict(model), 0, range(CFG.num_moe_experts)))
    B, S, C = 3, 11, CFG.kv_channels
    x_BSD = torch.randn(B, S, CFG.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(torch.arange(S).expand(B, S), C, CFG.rotary_base, torch.float32, S)
    # megatron-core's rotary embedding [S, 1, 1, C]: the angles, both halves (rotate-half).
    inv_freq = 1.0 / (CFG.rotary_base ** (torch.arange(0, C, 2, dtype=torch.float64) / C))
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat([ang, ang], dim=-1).float()[:, None, None, :]
    with torch.no_grad():
        ours = model.decoder.layers[0].self_attention(x_BSD, cos[:, :, None, None], sin[:, :, None, None], None)
        theirs, _bias = layer.self_attention(x_BSD.transpose(0, 1).contiguous(), None, rotary_pos_emb=emb)
        theirs = theirs.transpose(0, 1)
        assert (theirs - ours).abs().max().item() < 1e-5 * ours.abs().max().item()
        # The same with another QKV layout is far off: the check sees the per-group interleave.
        layer.self_attention.linear_qkv.weight.copy_(layer.self_attention.linear_qkv.weight.roll(C, 0))
        wrong = layer.self_attention(x_BSD.transpose(0, 1).contiguous(), None, rotary_pos_emb=emb)[0]
        assert (wrong.transpose(0, 1) - ours).abs().max().item() > 1e-2 * ours.abs().max().item()


def test_te_spec_names_fuse_the_input_norm_and_group_the_experts():
    canon = canonical_state_dict(_model())
    owned = [4, 5, 6, 7]  # EP rank 1 of 2: experts 4..7 are its block-local 0..3
    te = megatron_layer_state(canon, 1, owned, spec="te")
    assert "input_layernorm.weight" not in te
    assert te["self_attention.linear_qkv.layer_norm_weight"] is canon["decoder.layers.1.input_layernorm.weight"]
    experts = "decoder.layers.1.mlp.experts.local_experts"
    assert te["mlp.experts.linear_fc1.weight2"] is canon[f"{experts}.6.linear_fc1.weight"]
    assert te["mlp.experts.linear_fc2.weight0"] is canon[f"{experts}.4.linear_fc2.weight"]
    assert {k for k in te if not k.startswith("mlp.experts.")} == {
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
        "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.router.weight"}
    back = from_megatron_layer_state(te, 1, owned, spec="te")
    assert all(back[k] is canon[k] for k in back) and len(back) == 7 + 2 * len(owned)
    with pytest.raises(ValueError, match="spec: expected one of local, te"):
        megatron_layer_state(canon, 0, owned, spec="apex")
