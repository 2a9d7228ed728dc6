"""One set of weights for both MoE backends, and megatron-core's layer names for them.

The torch backend's state dict (`Qwen3MoeModel.state_dict()` with plain-PyTorch MoE blocks) is the
canonical form: HuggingFace checkpoints load into it and export from it (`megatron_rl.models.hf`).
`canonical_state_dict` gives that form for a model whichever backend hosts its MoE layers, so
weights move torch -> megatron -> torch with equal checksums and a megatron-backed model exports
to HuggingFace like a torch one.

`megatron_layer_state` names one decoder layer's weights as megatron-core's GPT `TransformerLayer`
holds them, for both of its specs:
- local (`get_gpt_layer_local_spec`): the names are ours, except that an EP rank's experts are
  numbered block-locally (`mlp.experts.local_experts.{j}` is the rank's j-th owned expert);
- TransformerEngine (`get_gpt_layer_with_transformer_engine_spec`): the input RMSNorm is fused into
  the QKV projection (`self_attention.linear_qkv.layer_norm_weight`, no `input_layernorm`), and the
  experts are TEGroupedMLP's `mlp.experts.linear_fc{1,2}.weight{j}`.
Both specs keep Megatron's fused, per-group interleaved QKV (`linear_qkv`: for each query group its
query heads, then its key head, then its value head), which `hf.py` builds from HF's separate
q/k/v projections, and the q/k RMSNorms (`q_layernorm`, `k_layernorm`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from megatron_rl.models.megatron_backend import MegatronMoE
from megatron_rl.models.params import expert_weight, tensor_digest

SPECS = ("local", "te")
_DENSE = ("self_attention.linear_qkv.weight", "self_attention.q_layernorm.weight",
          "self_attention.k_layernorm.weight", "self_attention.linear_proj.weight",
          "pre_mlp_layernorm.weight", "mlp.router.weight")


def canonical_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The parameters of `model` (a Qwen3MoeModel) under the torch backend's names and global
    expert indices, whether its MoE layers are the torch backend's or `MegatronMoE`."""
    out = {k: p for k, p in model.named_parameters() if ".mlp.layer." not in k}
    for i, layer in enumerate(model.decoder.layers):
        moe = layer.mlp
        if isinstance(moe, MegatronMoE):
            pre = f"decoder.layers.{i}."
            out[pre + "mlp.router.weight"] = moe.router_weight
            for j, e in enumerate(moe.local_experts):
                fc1, fc2 = moe.expert_params(j)
                out[pre + expert_weight(e, 1)] = fc1
                out[pre + expert_weight(e, 2)] = fc2
    return out


def canonical_state_dict(model) -> dict[str, torch.Tensor]:
    """`canonical_parameters` as a state dict (the tensors share the parameters' storage)."""
    return {k: p.detach() for k, p in canonical_parameters(model).items()}


def state_digests(sd: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Per-tensor sha256 of a state dict (dtype, shape and bytes)."""
    return {k: tensor_digest(v) for k, v in sorted(sd.items())}


def _expert_name(spec: str, j: int, fc: int) -> str:
    if spec == "te":  # TEGroupedMLP
        return f"mlp.experts.linear_fc{fc}.weight{j}"
    return expert_weight(j, fc)  # SequentialMLP


def megatron_layer_state(sd: Mapping[str, torch.Tensor], layer: int, owned: Sequence[int],
                         spec: str = "local") -> dict[str, torch.Tensor]:
    """Decoder layer `layer` of the canonical `sd` as megatron-core's TransformerLayer of `spec`
    names it, on an EP rank owning the experts `owned` (in block order)."""
    if spec not in SPECS:
        raise ValueError(f"spec: expected one of {', '.join(SPECS)}, got {spec!r}")
    pre = f"decoder.layers.{layer}."
    norm = "self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight"
    out = {norm: sd[pre + "input_layernorm.weight"]}
    out.update({k: sd[pre + k] for k in _DENSE})
    for j, e in enumerate(owned):
        for fc in (1, 2):
            out[_expert_name(spec, j, fc)] = sd[pre + expert_weight(e, fc)]
    return out


def from_megatron_layer_state(msd: Mapping[str, torch.Tensor], layer: int, owned: Sequence[int],
                              spec: str = "local") -> dict[str, torch.Tensor]:
    """The inverse of `megatron_layer_state`: canonical names of one layer (TE's `_extra_state`
    entries, which hold no weights, are ignored)."""
    if spec not in SPECS:
        raise ValueError(f"spec: expected one of {', '.join(SPECS)}, got {spec!r}")
    pre = f"decoder.layers.{layer}."
    norm = "self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight"
    out = {pre + "input_layernorm.weight": msd[norm]}
    out.update({pre + k: msd[k] for k in _DENSE})
    for j, e in enumerate(owned):
        for fc in (1, 2):
            out[pre + expert_weight(e, fc)] = msd[_expert_name(spec, j, fc)]
    return out
