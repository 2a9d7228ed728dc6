"""Qwen3-MoE in plain PyTorch, with Megatron-style parameter names and no parallelism inside.

Shape suffixes: B batch, S sequence (queries), L keys, D hidden, H query heads, G query groups
(KV heads), C head dim (kv_channels), V vocab, T flattened tokens.

Architecture (HF `Qwen3MoeForCausalLM`): RMSNorm pre-norm blocks; GQA attention with RMSNorm on
each head's q and k (Megatron `qk_layernorm`) and rotate-half RoPE; an MoE block on every layer.
`linear_qkv` is Megatron's fused, per-group interleaved projection: for each of the G groups, the
group's H/G query heads, then its key head, then its value head.

Two ways in: `forward(input_ids)` (full causal pass, for training and oracles) and
`forward(input_ids, positions=..., kv=..., token_mask=...)` for the rollout engine, whose `kv` is one
forward through its KV cache (`KVForwardLike`: rollout/kv/attention.py's `KVForward`; it stores the keys
and runs the attention over each sequence's own length).
`token_mask` marks real (non-padding) tokens: only those reach an expert.
"""
from __future__ import annotations

import functools
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.moe import MoELayer, widens

# The torch dtype that a rollout or trainer config's `dtype` names.
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class KVForwardLike(Protocol):
    """One forward through a KV cache."""

    max_len: int  # positions per sequence: the RoPE table covers them all, built once

    def attend(self, layer: int, q_BHSC: torch.Tensor, k_BGSC: torch.Tensor,
               v_BGSC: torch.Tensor) -> torch.Tensor:
        """Store the new keys/values of `layer`; return the queries' attention output [B, H, S, C]
        over each sequence's keys so far (causal within the new tokens)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, without the weight; the casts are skipped when they are no-ops."""
    xf = x.float() if widens(x.dtype) else x
    # In place on the [.., 1] statistic only (fewer allocations; autograd-safe: nothing saved is modified).
    xf = xf * (xf * xf).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return xf.to(x.dtype) if widens(x.dtype) else xf


@functools.lru_cache(maxsize=16)
def _rope_table(dim: int, base: float, dtype: torch.dtype, positions: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [positions, dim] for positions 0..positions-1, angles in float64; the
    first half of sin is negated (see `apply_rope`). A normal tensor (not an inference one), so
    training can use it under autograd too."""
    with torch.inference_mode(False):
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq
        ang = torch.cat([ang, ang], dim=-1)
        sin = ang.sin()
        sin[:, : dim // 2] *= -1
        return ang.cos().to(device, dtype), sin.to(device, dtype)


def rope_tables(dim: int, base: float, dtype: torch.dtype, n_positions: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and signed sin tables that cover positions 0..n_positions-1 (rounded up to a power
    of two, so that few tables are ever built). A captured decode graph reads them: its runner keeps
    them referenced and keys its graphs on their addresses (rollout/decode_step.py)."""
    return _rope_table(dim, base, dtype, max(256, 1 << (max(n_positions, 1) - 1).bit_length()), device)


def rope_cos_sin(positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype, n_positions: int):
    """cos and signed sin [*positions.shape, dim]: rows of `rope_tables`; the caller knows
    `n_positions` on the host (the KV cache's length, the sequence length), so no position is read
    back from the device."""
    cos, sin = rope_tables(dim, base, dtype, n_positions, positions.device)
    return cos[positions], sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the last dim; `cos`/`sin` (signed, from `rope_cos_sin`) already
    broadcast against `x`. HF's rotate_half(x) * sin is cat(-x2, x1) * sin; rolling x by half gives
    cat(x2, x1), and the sign lives in the table's sin: the same products, one op instead of four."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class SelfAttention(nn.Module):
    def __init__(self, config: MoEModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.layer, self.cfg = layer, config
        c, g, hpg = config.kv_channels, config.num_query_groups, config.heads_per_group
        self.linear_qkv = nn.Linear(config.hidden_size, g * (hpg + 2) * c, bias=False, dtype=dtype)
        self.q_layernorm = RMSNorm(c, config.layernorm_epsilon, dtype)
        self.k_layernorm = RMSNorm(c, config.layernorm_epsilon, dtype)
        self.linear_proj = nn.Linear(config.num_attention_heads * c, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x_BSD, cos_BS11C, sin_BS11C, kv: KVForwardLike | None):
        cfg = self.cfg
        B, S, _ = x_BSD.shape
        c, g, hpg = cfg.kv_channels, cfg.num_query_groups, cfg.heads_per_group
        # F.linear on the weight, not the Linear module: a module call's bookkeeping costs as much
        # as a tiny decode matmul on CPU (no hooks are used on these layers).
        qkv_BSGNC = F.linear(x_BSD, self.linear_qkv.weight).view(B, S, g, hpg + 2, c)
        # Every group's H/G query heads and its key head are normalised and rotated in one pass:
        # both are per-head, elementwise ops, so the numbers equal separate q and k passes.
        w_NC = torch.cat([self.q_layernorm.weight.expand(hpg, c), self.k_layernorm.weight[None]])
        qk_BSGNC = w_NC * rms_normalize(qkv_BSGNC[:, :, :, :hpg + 1], cfg.layernorm_epsilon)
        qk_BSGNC = apply_rope(qk_BSGNC, cos_BS11C, sin_BS11C)
        q_BHSC = qk_BSGNC[:, :, :, :hpg].reshape(B, S, g * hpg, c).transpose(1, 2)
        k_BGSC = qk_BSGNC[:, :, :, hpg].transpose(1, 2)
        v_BGSC = qkv_BSGNC[:, :, :, hpg + 1].transpose(1, 2)
        if kv is None:
            # GQA: query head h reads KV group h // (H/G), as HF's repeat_kv lays them out
            # (`enable_gqa`). The CPU kernel accumulates the softmax in fp32 for half types, as HF does.
            out_BHSC = F.scaled_dot_product_attention(q_BHSC, k_BGSC, v_BGSC, is_causal=True, enable_gqa=True)
        else:
            out_BHSC = kv.attend(self.layer, q_BHSC, k_BGSC, v_BGSC)
        out_BSHC = out_BHSC.transpose(1, 2)
        return F.linear(out_BSHC.reshape(B, S, -1), self.linear_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, config: MoEModelConfig, layer: int, experts: Iterable[int], dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon, dtype)
        self.self_attention = SelfAttention(config, layer, dtype)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon, dtype)
        self.mlp = MoELayer(config, experts, dtype)

    def forward(self, x_BSD, cos, sin, kv, token_mask_BS):
        x_BSD = x_BSD + self.self_attention(self.input_layernorm(x_BSD), cos, sin, kv)
        h_BSD = self.pre_mlp_layernorm(x_BSD)
        if token_mask_BS is not None and isinstance(self.mlp, MoELayer):
            # Padding rows go to the null expert: no GEMM, no all-to-all bytes, zeros out, and no
            # host-side compaction (a boolean index would read the mask back).
            y_TD = self.mlp(h_BSD.reshape(-1, h_BSD.shape[-1]), token_mask_BS.reshape(-1))
            return x_BSD + y_TD.view_as(h_BSD)
        if token_mask_BS is None:
            y_BSD = self.mlp(h_BSD.reshape(-1, h_BSD.shape[-1])).view_as(h_BSD)
        else:
            # megatron-core's block routes every row it gets: padding rows are left out here.
            y_BSD = torch.zeros_like(h_BSD)
            y_BSD[token_mask_BS] = self.mlp(h_BSD[token_mask_BS])
        return x_BSD + y_BSD


class Embedding(nn.Module):
    def __init__(self, config: MoEModelConfig, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)


class Decoder(nn.Module):
    def __init__(self, config: MoEModelConfig, experts: Iterable[int], dtype: torch.dtype):
        super().__init__()
        experts = list(experts)
        self.layers = nn.ModuleList(DecoderLayer(config, i, experts, dtype) for i in range(config.num_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon, dtype)


class Qwen3MoeModel(nn.Module):
    """`experts`: the global expert indices this rank holds (default: all of them)."""

    def __init__(self, config: MoEModelConfig, experts: Iterable[int] | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.recompute_activations = False  # training switch; see `hidden_states`
        held = range(config.num_moe_experts) if experts is None else experts
        self.embedding = Embedding(config, dtype)
        self.decoder = Decoder(config, held, dtype)
        if config.untie_embeddings_and_output_weights:
            self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    @property
    def device(self) -> torch.device:
        return self.embedding.word_embeddings.weight.device

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [layer.mlp for layer in self.decoder.layers]

    def set_dispatcher(self, dispatcher) -> None:
        """Route every MoE layer through `dispatcher` (how `elastic/` swaps the EP group)."""
        for moe in self.moe_layers:
            moe.dispatcher = dispatcher

    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed`, identical for any subset of experts held."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.init_method_std
        with torch.no_grad():
            for name, p in sorted(self.named_parameters(), key=lambda kv: kv[0]):
                if "local_experts" in name:
                    continue
                if name.endswith("layernorm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * std)
            # Every expert's weights come from its own stream, so a rank holding a subset of the
            # experts gets exactly the weights the full model has.
            for li, moe in enumerate(self.moe_layers):
                for e in moe.experts.held():
                    g = torch.Generator().manual_seed(seed * 1_000_003 + li * 10_007 + e)
                    for p in moe.experts.get(e).parameters():
                        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)

    def output_weight(self) -> torch.Tensor:
        if self.config.untie_embeddings_and_output_weights:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def hidden_states(self, input_ids_BS: torch.Tensor, positions_BS: torch.Tensor | None = None,
                      kv: KVForwardLike | None = None,
                      token_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states [B, S, D] that the output layer turns into logits.

        With `recompute_activations` set and gradients on, each decoder layer keeps only its
        input for backward and reruns its forward there (`torch.utils.checkpoint`), MoE
        all-to-all included: every rank reruns the same layers in the same order."""
        B, S = input_ids_BS.shape
        if positions_BS is None:
            positions_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
        n_positions = kv.max_len if kv is not None else S if positions_BS is None else int(positions_BS.max()) + 1
        cos_BSC, sin_BSC = rope_cos_sin(positions_BS, self.config.kv_channels, self.config.rotary_base, self.dtype,
                                        n_positions)
        cos, sin = cos_BSC[:, :, None, None], sin_BSC[:, :, None, None]  # against [B, S, G, N, C]
        x_BSD = self.embedding.word_embeddings(input_ids_BS)
        recompute = self.recompute_activations and kv is None and torch.is_grad_enabled()
        for layer in self.decoder.layers:
            if recompute:
                x_BSD = checkpoint(layer, x_BSD, cos, sin, None, token_mask_BS, use_reentrant=False)
            else:
                x_BSD = layer(x_BSD, cos, sin, kv, token_mask_BS)
        return self.decoder.final_layernorm(x_BSD)

    def forward(self, input_ids_BS: torch.Tensor, positions_BS: torch.Tensor | None = None,
                kv: KVForwardLike | None = None, token_mask_BS: torch.Tensor | None = None,
                logits_at_B: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, V]; with `logits_at_B`, only at those positions: [B, V]."""
        x_BSD = self.hidden_states(input_ids_BS, positions_BS, kv, token_mask_BS)
        if logits_at_B is not None:
            x_BSD = x_BSD[torch.arange(x_BSD.shape[0], device=x_BSD.device), logits_at_B]
        return F.linear(x_BSD, self.output_weight())
