"""HuggingFace Qwen3-MoE checkpoints <-> our Megatron-named state dict.

Reads safetensors in both expert layouts found in the wild: per-expert tensors
(`mlp.experts.<e>.{gate,up,down}_proj.weight`, the released checkpoints and what `transformers` 5
writes with `save_pretrained`) and the fused in-memory layout (`mlp.experts.gate_up_proj` [E, 2F, D],
`mlp.experts.down_proj` [E, D, F]). Sharded checkpoints (`model.safetensors.index.json`) work too.
An EP rank can load only the experts it holds.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Container, Iterable

import torch

from elastic.errors import shorten
from megatron_rl.errors import CheckpointError
from megatron_rl.files.json_input import loads
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.hf_writer import SHARD_BYTES, write_index_and_configs, write_shards
from megatron_rl.models.megatron_weights import canonical_state_dict
from megatron_rl.models.params import expert_weight
from megatron_rl.models.qwen3_moe import Qwen3MoeModel


def _qkv_to_megatron(q_HCD, k_GCD, v_GCD, cfg: MoEModelConfig) -> torch.Tensor:
    g, hpg, c = cfg.num_query_groups, cfg.heads_per_group, cfg.kv_channels
    D = q_HCD.shape[-1]
    q = q_HCD.reshape(g, hpg * c, D)
    return torch.cat([q, k_GCD.reshape(g, c, D), v_GCD.reshape(g, c, D)], dim=1).reshape(-1, D)


def _qkv_from_megatron(qkv, cfg: MoEModelConfig):
    g, hpg, c = cfg.num_query_groups, cfg.heads_per_group, cfg.kv_channels
    D = qkv.shape[-1]
    per = qkv.reshape(g, (hpg + 2) * c, D)
    q = per[:, : hpg * c].reshape(g * hpg * c, D)
    k = per[:, hpg * c:(hpg + 1) * c].reshape(g * c, D)
    v = per[:, (hpg + 1) * c:].reshape(g * c, D)
    return q, k, v


class _SafetensorsDir:
    """Lazy tensor access over one or many safetensors files."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = loads(index.read_bytes())["weight_map"]
                files = sorted(set(weight_map.values()))
                if not all(isinstance(f, str) and Path(f).name == f for f in files):
                    raise ValueError("weight_map names a file outside the folder")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: unreadable index ({shorten(e)})") from None
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files found")
        self.handles, self.where = {}, {}
        for f in files:
            try:
                h = safe_open(str(path / f), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{path / f}: unreadable safetensors file ({e})") from None
            self.handles[f] = h
            for k in h.keys():
                self.where[k] = f
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def _handle(self, key: str):
        if key not in self.where:
            raise CheckpointError(f"{self.path}: tensor {key!r} is missing from the checkpoint")
        return self.handles[self.where[key]]

    def get(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def shape(self, key: str) -> list[int]:
        """The stored shape, read from the file's header (no tensor data is read)."""
        return self._handle(key).get_slice(key).get_shape()


def hf_to_megatron(src, cfg: MoEModelConfig, experts: Iterable[int]) -> dict[str, torch.Tensor]:
    """Build our state dict from `src` (anything with `get(key)` and `in`)."""
    sd = {"embedding.word_embeddings.weight": src.get("model.embed_tokens.weight"),
          "decoder.final_layernorm.weight": src.get("model.norm.weight")}
    if cfg.untie_embeddings_and_output_weights:
        sd["output_layer.weight"] = src.get("lm_head.weight")
    experts = list(experts)
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        sd[mg + "input_layernorm.weight"] = src.get(hf + "input_layernorm.weight")
        sd[mg + "pre_mlp_layernorm.weight"] = src.get(hf + "post_attention_layernorm.weight")
        sd[mg + "self_attention.linear_qkv.weight"] = _qkv_to_megatron(
            src.get(hf + "self_attn.q_proj.weight"), src.get(hf + "self_attn.k_proj.weight"),
            src.get(hf + "self_attn.v_proj.weight"), cfg)
        sd[mg + "self_attention.q_layernorm.weight"] = src.get(hf + "self_attn.q_norm.weight")
        sd[mg + "self_attention.k_layernorm.weight"] = src.get(hf + "self_attn.k_norm.weight")
        sd[mg + "self_attention.linear_proj.weight"] = src.get(hf + "self_attn.o_proj.weight")
        sd[mg + "mlp.router.weight"] = src.get(hf + "mlp.gate.weight")
        fused = hf + "mlp.experts.gate_up_proj" in src
        if fused:
            gate_up_E2FD = src.get(hf + "mlp.experts.gate_up_proj")
            down_EDF = src.get(hf + "mlp.experts.down_proj")
        for e in experts:
            fc1, fc2 = mg + expert_weight(e, 1), mg + expert_weight(e, 2)
            if fused:
                sd[fc1] = gate_up_E2FD[e]
                sd[fc2] = down_EDF[e]
            else:
                ex = hf + f"mlp.experts.{e}."
                sd[fc1] = torch.cat([src.get(ex + "gate_proj.weight"), src.get(ex + "up_proj.weight")], dim=0)
                sd[fc2] = src.get(ex + "down_proj.weight")
    return sd


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: MoEModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> HF per-expert names (the layout of released checkpoints); the experts `sd`
    holds (all of them for a whole model)."""
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["output_layer.weight"]
    F_ = cfg.moe_ffn_hidden_size
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[hf + "input_layernorm.weight"] = sd[mg + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = sd[mg + "pre_mlp_layernorm.weight"]
        q, k, v = _qkv_from_megatron(sd[mg + "self_attention.linear_qkv.weight"], cfg)
        out[hf + "self_attn.q_proj.weight"], out[hf + "self_attn.k_proj.weight"] = q, k
        out[hf + "self_attn.v_proj.weight"] = v
        out[hf + "self_attn.q_norm.weight"] = sd[mg + "self_attention.q_layernorm.weight"]
        out[hf + "self_attn.k_norm.weight"] = sd[mg + "self_attention.k_layernorm.weight"]
        out[hf + "self_attn.o_proj.weight"] = sd[mg + "self_attention.linear_proj.weight"]
        out[hf + "mlp.gate.weight"] = sd[mg + "mlp.router.weight"]
        for e in range(cfg.num_moe_experts):
            if mg + expert_weight(e, 1) not in sd:
                continue  # another rank's expert (an EP rank converts what it holds)
            fc1 = sd[mg + expert_weight(e, 1)]
            out[hf + f"mlp.experts.{e}.gate_proj.weight"] = fc1[:F_]
            out[hf + f"mlp.experts.{e}.up_proj.weight"] = fc1[F_:]
            out[hf + f"mlp.experts.{e}.down_proj.weight"] = sd[mg + expert_weight(e, 2)]
    return {k: v.contiguous() for k, v in out.items()}


def read_hf_config(path: str | Path) -> MoEModelConfig:
    path = Path(path)
    if not path.is_dir():
        found = "it is a file" if path.exists() else "it does not exist"
        raise CheckpointError(f"{path}: expected a HuggingFace checkpoint directory "
                              f"(config.json and *.safetensors), but {found}")
    cfg_file = path / "config.json"
    try:
        hf = loads(cfg_file.read_text())
    except OSError as e:
        raise CheckpointError(f"{cfg_file}: cannot read checkpoint config ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not UTF-8 text (byte offset {e.start})") from None
    except ValueError as e:  # (json_input: nested too deeply)
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    return MoEModelConfig.from_hf(hf, str(cfg_file))


def load_hf_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32,
                       experts: Iterable[int] | None = None) -> Qwen3MoeModel:
    """Load a HuggingFace Qwen3-MoE checkpoint directory; `experts` limits which experts are held."""
    path = Path(path)
    cfg, st = _checked(path)
    held = list(range(cfg.num_moe_experts)) if experts is None else sorted(experts)
    model = Qwen3MoeModel(cfg, held, dtype)
    model.load_state_dict(_cast_finite(path, hf_to_megatron(st, cfg, held), dtype), strict=True)
    return model


def _cast_finite(path: Path, sd: dict, dtype: torch.dtype) -> dict:
    """`sd` in the run's dtype. A NaN or inf weight would generate garbage (every token 0) and train
    on NaN: refuse it, checked after the cast, so a float64 1e300 that becomes inf in float32 is named
    as the overflow it is."""
    out = {}
    for k, v in sd.items():
        cast = v.to(dtype)
        if cast.is_floating_point() and not torch.isfinite(cast).all():
            bad = ~torch.isfinite(cast)
            if torch.isfinite(v[bad]).all():
                big = float(v[bad].abs().max())
                raise CheckpointError(f"{path}: weight {k} holds {int(bad.sum())} value(s) (largest "
                                      f"{big:.3g}) that overflow {str(dtype).removeprefix('torch.')} "
                                      f"(max {torch.finfo(dtype).max:.3g})")
            raise CheckpointError(f"{path}: weight {k} holds {int(bad.sum())} non-finite value(s) (NaN or inf)")
        out[k] = cast
    return out


def check_same_shape(path: str | Path, configured: MoEModelConfig, where: str = "config") -> None:
    """The checkpoint at `path` must be of exactly the `configured` model shape."""
    have, want = read_hf_config(path).to_dict(), configured.to_dict()
    diff = [f"{k}: checkpoint {have[k]!r}, {where} {want[k]!r}" for k in want if have[k] != want[k]]
    if diff:
        raise CheckpointError(f"{path}: checkpoint is for another model shape ({'; '.join(diff[:4])})")


def check_hf_checkpoint(path: str | Path) -> MoEModelConfig:
    """Every check `load_hf_checkpoint` makes, from config.json and the safetensors headers only.

    No tensor data is read, so the CLI can reject a bad checkpoint before it starts any rank.
    """
    return _checked(Path(path))[0]


def _checked(path: Path) -> tuple[MoEModelConfig, _SafetensorsDir]:
    """The checkpoint's config and its tensors, every tensor's stored shape (its header) checked
    against what config.json implies (`hf_shapes`): a layer holds its experts per expert or fused."""
    cfg = read_hf_config(path)
    st = _SafetensorsDir(path)
    fused = {i for i in range(cfg.num_layers) if f"model.layers.{i}.mlp.experts.gate_up_proj" in st}
    for k, want in hf_shapes(cfg, fused).items():
        have = tuple(st.shape(k))
        if have != want:
            raise CheckpointError(f"{path}: tensor {k} has shape {have}, config.json implies {want}")
    return cfg, st


def hf_shapes(cfg: MoEModelConfig, fused_layers: Container[int] = ()) -> dict[str, tuple[int, ...]]:
    """Every tensor of a HuggingFace checkpoint of a model of shape `cfg`, in the order the shards
    hold them: name -> shape. Experts per expert (the released checkpoints' layout), except in
    `fused_layers` (`mlp.experts.gate_up_proj` [E, 2F, D], `down_proj` [E, D, F])."""
    D, V, F, C, E = cfg.hidden_size, cfg.vocab_size, cfg.moe_ffn_hidden_size, cfg.kv_channels, cfg.num_moe_experts
    q, kv = cfg.num_attention_heads * C, cfg.num_query_groups * C
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}."
        out |= {hf + "input_layernorm.weight": (D,), hf + "post_attention_layernorm.weight": (D,),
                hf + "self_attn.q_proj.weight": (q, D), hf + "self_attn.k_proj.weight": (kv, D),
                hf + "self_attn.v_proj.weight": (kv, D), hf + "self_attn.q_norm.weight": (C,),
                hf + "self_attn.k_norm.weight": (C,), hf + "self_attn.o_proj.weight": (D, q),
                hf + "mlp.gate.weight": (E, D)}
        if i in fused_layers:
            out |= {hf + "mlp.experts.gate_up_proj": (E, 2 * F, D), hf + "mlp.experts.down_proj": (E, D, F)}
            continue
        for e in range(E):
            ex = hf + f"mlp.experts.{e}."
            out |= {ex + "gate_proj.weight": (F, D), ex + "up_proj.weight": (F, D), ex + "down_proj.weight": (D, F)}
    return out


def hf_layout(cfg: MoEModelConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every HF tensor of a model of shape `cfg` held in `dtype`, in the order the shards hold them:
    name -> (shape, dtype)."""
    return {k: (shape, dtype) for k, shape in hf_shapes(cfg).items()}


def save_hf_checkpoint(model: Qwen3MoeModel, path: str | Path, dtype: torch.dtype | None = None,
                       tokenizer=None, shard_bytes: int | None = None) -> None:
    """Export a model holding every expert as a HuggingFace checkpoint directory (either MoE
    backend: the megatron one's weights are read under the torch backend's names), in one process:
    the same files as the ranks' export (rl/model_setup.py export_hf; models/hf_writer.py).
    `tokenizer`: the run's (data/tokenizer.py), for the bos/eos ids and an HF tokenizer's files."""
    cfg = model.config
    sd = canonical_state_dict(model)
    missing = [e for e in range(cfg.num_moe_experts)
               if "decoder.layers.0." + expert_weight(e, 1) not in sd]
    if missing:
        raise ValueError(f"export needs every expert on this rank; missing {sorted(missing)[:5]}...")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = megatron_to_hf({k: v.detach() for k, v in sd.items()}, cfg)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    layout = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    shard_bytes = shard_bytes or SHARD_BYTES
    failed = write_shards(tensors, layout, path, shard_bytes, dict.fromkeys(range(cfg.num_moe_experts), 0), 0, 1)
    if failed is not None:
        raise failed
    write_index_and_configs(path, layout, shard_bytes, cfg, dtype or model.dtype, tokenizer)
