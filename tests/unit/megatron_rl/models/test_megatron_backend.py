"""The megatron backend on a CPU machine: the clear refusal, the TransformerConfig mapping, and the
construction of megatron-core's MoELayer on a one-rank gloo group with the torch backend's weights.

Multi-rank pg_collection wiring and the EP shrink are in tests/distributed/test_megatron_elastic.py;
the forward pass needs CUDA (tools/gpu_check.sh).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.backend_rules import backend_rules
from megatron_rl.backends import backend
from megatron_rl.errors import FlexFloorError
from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.models.megatron_backend import (
    install_megatron_moe,
    moe_pg_collection,
    require_backend,
    to_torch_moe,
    transformer_config,
)

CPU_BUILD = dict(dispatcher="allgather", dtype=torch.float32, expert_module="SequentialMLP", device="cpu")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@no_cuda
def test_megatron_backend_on_cpu_points_to_the_torch_backend():
    with pytest.raises(FlexFloorError, match=r"no CUDA device; use `backend: torch`"):
        require_backend()
    with pytest.raises(FlexFloorError, match=r"no CUDA device; use `backend: torch`"):
        backend_rules("megatron").preflight("bfloat16")
    backend_rules("torch").preflight("float64")
    with pytest.raises(FlexFloorError, match=r"expected one of torch, megatron, got 'tpu'"):
        backend_rules("tpu")


def test_transformer_config_carries_the_model_fields():
    m = MoEModelConfig(num_layers=3, hidden_size=96, num_attention_heads=6, num_query_groups=3, kv_channels=32,
                       num_moe_experts=16, moe_router_topk=4, moe_ffn_hidden_size=48, layernorm_epsilon=1e-5)
    tc = transformer_config(m, ep_size=4, dispatcher="alltoall", dtype=torch.bfloat16, device="cpu")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
                 "layernorm_epsilon"):
        assert getattr(tc, name) == getattr(m, name), name
    assert tc.activation_func is F.silu and tc.gated_linear_unit and not tc.add_bias_linear
    assert tc.expert_model_parallel_size == 4 and tc.moe_token_dispatcher_type == "alltoall"
    assert tc.moe_grouped_gemm and tc.bf16 and tc.params_dtype == torch.bfloat16
    assert tc.moe_router_dtype == "fp32" and not tc.perform_initialization
    # Defect 8: Qwen3 has no dropout; megatron's defaults (0.1) would perturb training forwards.
    assert tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0
    flex = transformer_config(m, ep_size=2, dispatcher="flex", device="cpu")
    assert flex.moe_flex_dispatcher_backend == "deepep"


def test_transformer_config_rejects_groups_megatron_cannot_split_over():
    with pytest.raises(FlexFloorError, match=r"8 experts do not divide over 3 ranks"):
        transformer_config(MoEModelConfig(), ep_size=3, device="cpu")
    with pytest.raises(FlexFloorError, match=r"dispatcher: expected one of alltoall, flex, allgather"):
        transformer_config(MoEModelConfig(), ep_size=1, dispatcher="deepep", device="cpu")


def test_megatron_layer_holds_the_torch_weights_and_gives_them_back(one_rank_group):
    model = Qwen3MoeModel(MoEModelConfig(), dtype=torch.float32)
    model.init_weights(7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pgc = moe_pg_collection(one_rank_group, one_rank_group)
    install_megatron_moe(model, pgc, **CPU_BUILD)
    for i, moe in enumerate(model.moe_layers):
        assert moe.layer.ep_group is one_rank_group and moe.layer.token_dispatcher.ep_group is one_rank_group
        assert moe.local_experts == list(range(8))
        # megatron-core's own parameter names hold the torch backend's tensors.
        params = dict(moe.layer.named_parameters())
        assert torch.equal(params["router.weight"], before[f"decoder.layers.{i}.mlp.router.weight"])
        assert torch.equal(params["experts.local_experts.5.linear_fc2.weight"],
                           before[f"decoder.layers.{i}.mlp.experts.local_experts.5.linear_fc2.weight"])
        back = to_torch_moe(moe).state_dict()
        for key, value in back.items():
            assert torch.equal(value, before[f"decoder.layers.{i}.mlp.{key}"]), key
    with pytest.raises(TypeError, match="already runs MegatronMoE"):
        install_megatron_moe(model, pgc, **CPU_BUILD)


def test_experts_are_te_grouped_gemm_where_te_imports_and_te_is_required_in_the_h100_image(monkeypatch):
    from megatron_rl.models import megatron_backend as mb

    monkeypatch.delenv(mb.IMAGE_ENV, raising=False)
    monkeypatch.setattr(mb, "transformer_engine", lambda: ("2.9.0", ""))
    assert mb.expert_kernel() == "TEGroupedMLP" == mb.megatron_options(torch.bfloat16)["expert_module"]
    assert mb.backend_report() == {"backend": "megatron", "experts": "TEGroupedMLP",
                                             "transformer_engine": "2.9.0"}
    monkeypatch.setattr(mb, "transformer_engine", lambda: (None, "OSError: libcudnn.so.9: cannot open"))
    # Without TE: torch._grouped_mm experts, not megatron-core's per-expert loop, unless asked for.
    assert mb.expert_kernel() == "GroupedMM" == mb.megatron_options(torch.bfloat16)["expert_module"]
    assert mb.megatron_options(torch.bfloat16, "SequentialMLP")["expert_module"] == "SequentialMLP"
    with pytest.raises(FlexFloorError, match="megatron experts: expected auto or one of"):
        mb.expert_kernel("loop")
    monkeypatch.setenv(mb.IMAGE_ENV, "h100")
    with pytest.raises(FlexFloorError, match=r"FLEXFLOOR_IMAGE=h100 but TransformerEngine does not import "
                                             r"\(OSError: libcudnn.so.9: cannot open\)"):
        mb.expert_kernel()
    assert backend("torch").describe() == {"backend": "torch"}  # the torch backend never asks for TE


@no_cuda
def test_transformer_engine_reports_why_it_does_not_import():
    from megatron_rl.models.megatron_backend import transformer_engine

    version, why = transformer_engine()
    assert version is None and why.startswith(("ModuleNotFoundError", "ImportError", "OSError", "RuntimeError"))
