"""What each field of a HuggingFace Qwen3-MoE `config.json` means to this model, field by field.

Every field of transformers' `Qwen3MoeConfig` (5.x, with `PreTrainedConfig`'s own, and the 4.x names
checkpoints still carry) is in exactly one of three groups, and a test holds that none is missing:
  - READ: `MoEModelConfig.from_hf` maps it onto the model;
  - REFUSED: the model implements one value of it (attention without bias, SiLU experts, full
    causal attention, default RoPE, ...); any other value is refused by name, since loading it would
    compute something else than transformers does (logits differed by up to 2.85) and the export
    would then describe the model falsely;
  - NO_EFFECT: it does not change what the network computes (bookkeeping, generation switches,
    fields read only under a refused setting), said why.
A field outside all three (another architecture's, a tool's) is not transformers' Qwen3-MoE either:
it is ignored, as transformers ignores it.
"""
from __future__ import annotations

from elastic.errors import shorten
from megatron_rl.errors import ConfigError

READ = frozenset({
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "vocab_size", "rms_norm_eps", "rope_parameters", "rope_theta", "max_position_embeddings",
    "tie_word_embeddings", "initializer_range",
})


def _default_rope(value) -> bool:
    """4.x's `rope_scaling`: absent or the default type (transformers 5 reads it as `rope_parameters`)."""
    return value is None or (isinstance(value, dict)
                             and value.get("rope_type", value.get("type", "default")) == "default")


# field -> (does this value compute what the model does, what the model implements)
REFUSED = {
    "attention_bias": (lambda v: v is False, "false: the attention projections here have no bias"),
    "hidden_act": (lambda v: v == "silu", "'silu': the experts' gate activation here is SiLU"),
    "use_sliding_window": (lambda v: v is False, "false: attention here is full causal attention"),
    "mlp_only_layers": (lambda v: v in (None, []), "[]: every layer here is an MoE layer"),
    "decoder_sparse_step": (lambda v: v == 1, "1: every layer here is an MoE layer"),
    "rope_scaling": (_default_rope, "null: RoPE here is the default, unscaled"),
    "attention_dropout": (lambda v: v in (0, 0.0), "0: training here runs no attention dropout"),
    "quantization_config": (lambda v: v is None, "absent: weights here are read as plain tensors"),
}

NO_EFFECT = {
    "sliding_window": "read only with use_sliding_window (refused)",
    "max_window_layers": "read only with use_sliding_window (refused)",
    "intermediate_size": "the width of dense MLP layers, which only mlp_only_layers / decoder_sparse_step make "
                         "(refused)",
    "use_cache": "transformers' generation switch; the engine always keeps a KV cache",
    "output_router_logits": "transformers' load-balancing loss when it trains; the GRPO loss has none",
    "router_aux_loss_coef": "transformers' load-balancing loss when it trains; the GRPO loss has none",
    "bos_token_id": "a token id: the tokenizer's, not the network's",
    "eos_token_id": "a token id: the tokenizer's, not the network's",
    "pad_token_id": "a token id: transformers also makes it the embedding's padding_idx, which fixes that "
                    "row's init and gradient, never a logit",
    "dtype": "the stored weights' dtype: they are cast to the run's dtype (checked finite)",
    "torch_dtype": "the stored weights' dtype (4.x name): they are cast to the run's dtype",
    "architectures": "transformers' bookkeeping",
    "transformers_version": "transformers' bookkeeping",
    "_name_or_path": "transformers' bookkeeping",
    "id2label": "a classification head's labels; a causal LM has none",
    "label2id": "a classification head's labels; a causal LM has none",
    "problem_type": "a classification head's loss; a causal LM has none",
    "is_encoder_decoder": "transformers' bookkeeping (Qwen3-MoE is a decoder)",
    "chunk_size_feed_forward": "Qwen3-MoE's forward never chunks its feed-forward",
    "return_dict": "transformers' output format",
    "output_attentions": "transformers' output options",
    "output_hidden_states": "transformers' output options",
}


def check_hf_fields(hf: dict, where: str) -> None:
    """Refuse a config.json whose fields ask for something the model does not compute (REFUSED)."""
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: expected a JSON object of fields, got a JSON {type(hf).__name__}")
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        shown = rope.get("rope_type") if isinstance(rope, dict) else rope
        raise ConfigError(f"{where}: rope_parameters.rope_type {shown!r} is not implemented here; expected "
                          "'default' (RoPE here is unscaled)")
    for name, (fits, implemented) in REFUSED.items():
        if name in hf and not fits(hf[name]):
            shown = str(hf[name]).lower() if isinstance(hf[name], bool) else shorten(repr(hf[name]), 80)
            raise ConfigError(f"{where}: {name} {shown} is not implemented here; expected {implemented}")
