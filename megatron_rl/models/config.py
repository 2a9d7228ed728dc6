"""The MoE model's configuration, named as megatron-core's `TransformerConfig` names it.

Fields keep Megatron's names (num_layers, num_query_groups, kv_channels, moe_router_topk, ...) so a
config moves to the megatron-core backend field by field (`transformer_config_kwargs`), and
`from_hf` maps a HuggingFace Qwen3-MoE `config.json` (refusing what the model does not compute,
models/hf_fields.py). Router semantics: Qwen3's `norm_topk_prob=True`
(softmax over all experts, keep top-k, renormalise) equals Megatron's `moe_router_pre_softmax=False`
(top-k of the logits, softmax over those k); `norm_topk_prob=False` is `moe_router_pre_softmax=True`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from elastic.planning.shape import MemoryBudget, ModelShape
from megatron_rl.config import require, require_size
from megatron_rl.errors import ConfigError
from megatron_rl.models.hf_fields import check_hf_fields


@dataclass
class MoEModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 16
    num_moe_experts: int = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 32
    moe_router_pre_softmax: bool = False
    vocab_size: int = 256
    layernorm_epsilon: float = 1e-6
    rotary_base: float = 1_000_000.0
    max_position_embeddings: int = 4096
    untie_embeddings_and_output_weights: bool = True
    init_method_std: float = 0.02

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "kv_channels", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                     "vocab_size", "max_position_embeddings"):
            require(getattr(self, name) > 0, f"{name}: expected > 0, got {getattr(self, name)}")
            require_size(getattr(self, name), name)
        require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
            f"num_query_groups ({self.num_query_groups})",
        )
        require(
            self.moe_router_topk <= self.num_moe_experts,
            f"moe_router_topk ({self.moe_router_topk}) exceeds num_moe_experts ({self.num_moe_experts})",
        )
        require(self.layernorm_epsilon > 0 and self.rotary_base > 1 and self.init_method_std >= 0,
                f"layernorm_epsilon > 0, rotary_base > 1 and init_method_std >= 0 expected, got "
                f"{self.layernorm_epsilon}, {self.rotary_base}, {self.init_method_std}")
        require(self.kv_channels % 2 == 0,
                f"kv_channels: expected an even number (RoPE rotates pairs), got {self.kv_channels}")

    def require_page_fits(self, page_size: int, field: str) -> None:
        """A KV page holds positions of one sequence: one longer than the model's positions sizes every
        request's cache past any sequence (kv_page_size 16777216 on a 4096-position model passed the
        config, then failed allocating in the ranks)."""
        require(page_size <= self.max_position_embeddings,
                f"{field}: expected at most model.max_position_embeddings ({self.max_position_embeddings}: "
                f"a page holds positions of one sequence), got {page_size}")

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def shape(self, dtype_bytes: int, budget: MemoryBudget, ranks_per_node: int) -> ModelShape:
        """The planner's and the cost model's view of this model (elastic/planning is pure Python
        and does not read this config): its real sizes in a `dtype_bytes` dtype, priced against
        `budget` (its KV bytes per token include any recorded routes)."""
        return ModelShape(
            name=f"{self.num_layers}-layer {self.num_moe_experts}-expert model", num_experts=self.num_moe_experts,
            topk=self.moe_router_topk, num_layers=self.num_layers, hidden_size=self.hidden_size,
            expert_ffn=self.moe_ffn_hidden_size, bytes_per_param=dtype_bytes,
            kv_bytes_per_token=budget.kv_bytes_per_token, dense_bytes=budget.dense_bytes,
            memory_per_rank_bytes=budget.device_bytes, memory_utilization=budget.utilization,
            ranks_per_node=ranks_per_node, num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups, kv_channels=self.kv_channels, vocab_size=self.vocab_size,
        )

    def transformer_config_kwargs(self) -> dict:
        """Keyword arguments for `megatron.core.transformer.TransformerConfig` (MoE on every layer)."""
        return dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels,
            ffn_hidden_size=self.moe_ffn_hidden_size,
            num_moe_experts=self.num_moe_experts,
            moe_router_topk=self.moe_router_topk,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_router_pre_softmax=self.moe_router_pre_softmax,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            layernorm_epsilon=self.layernorm_epsilon,
            normalization="RMSNorm",
            qk_layernorm=True,
            gated_linear_unit=True,
            add_bias_linear=False,
            init_method_std=self.init_method_std,
        )

    # ---- HuggingFace config.json <-> this --------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict, where: str = "config.json") -> "MoEModelConfig":
        """`hf`'s fields onto this config; a field asking for what the model does not compute is
        refused by name (models/hf_fields.py says what each field of Qwen3MoeConfig means here)."""
        check_hf_fields(hf, where)
        if hf.get("model_type") not in (None, "qwen3_moe"):
            raise ConfigError(f"{where}: model_type is {hf.get('model_type')!r}, expected 'qwen3_moe'")
        try:
            rope = hf.get("rope_parameters") or {}
            theta = rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0))
            heads = hf["num_attention_heads"]
            return cls(
                num_layers=hf["num_hidden_layers"],
                hidden_size=hf["hidden_size"],
                num_attention_heads=heads,
                num_query_groups=hf.get("num_key_value_heads", heads),
                kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
                num_moe_experts=hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
                moe_router_topk=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
                vocab_size=hf["vocab_size"],
                layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
                rotary_base=float(theta),
                max_position_embeddings=hf.get("max_position_embeddings", 32768),
                untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                init_method_std=hf.get("initializer_range", 0.02),
            )
        except KeyError as e:
            raise ConfigError(f"{where}: missing field {e.args[0]!r}") from None
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        except (TypeError, ValueError) as e:  # e.g. a string where a number belongs
            raise ConfigError(f"{where}: a field has the wrong type ({e})") from None

    def to_hf(self) -> dict:
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.kv_channels,
            "num_experts": self.num_moe_experts,
            "num_experts_per_tok": self.moe_router_topk,
            "moe_intermediate_size": self.moe_ffn_hidden_size,
            "intermediate_size": self.moe_ffn_hidden_size,
            "norm_topk_prob": not self.moe_router_pre_softmax,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.layernorm_epsilon,
            "rope_parameters": {"rope_theta": self.rotary_base, "rope_type": "default"},
            "rope_theta": self.rotary_base,  # transformers 4.x reads only this (else 10000)
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": not self.untie_embeddings_and_output_weights,
            "initializer_range": self.init_method_std,
            "hidden_act": "silu",
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }

    def to_dict(self) -> dict:
        return asdict(self)
