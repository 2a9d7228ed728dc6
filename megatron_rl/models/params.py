"""What every floor asks of a parameter: an expert's name, is it an expert's, and its digest.

Both MoE backends and the layers above them (checkpoints, the update, the elastic engines'
checksums, the HuggingFace mapping) ask these here, so that the naming of experts and the digest
have one home below them.
"""
from __future__ import annotations

import hashlib

import torch


def expert_weight(e: int, fc: int) -> str:
    """Expert `e`'s `linear_fc{fc}` weight (fc 1: [gate; up], fc 2: down), named inside its decoder
    layer as the torch backend holds it (by global index: the canonical names checkpoints and the
    HuggingFace mapping use) and as megatron-core's SequentialMLP does (by local index)."""
    return f"mlp.experts.local_experts.{e}.linear_fc{fc}.weight"


def is_expert_param(name: str) -> bool:
    # `.local_experts.`: the torch backend's experts (and the canonical names); `.mlp.layer.experts.`:
    # megatron-core's experts (SequentialMLP or TEGroupedMLP) in MegatronMoE.
    return ".local_experts." in name or ".mlp.layer.experts." in name


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
