"""Every field of transformers' Qwen3MoeConfig is read, refused by name, or listed (and shown here) as
not affecting the computation (megatron_rl/models/hf_fields.py)."""
import json

import pytest
import torch

from megatron_rl.errors import ConfigError
from megatron_rl.models import MoEModelConfig, load_hf_checkpoint
from megatron_rl.models.hf_fields import NO_EFFECT, READ, REFUSED, check_hf_fields

transformers = pytest.importorskip("transformers")

# The fields of Qwen/Qwen3-30B-A3B's config.json (transformers 4.51 wrote it): names transformers 5 reads
# under other names (rope_theta, rope_scaling, torch_dtype) or no longer declares (max_window_layers).
QWEN3_30B_A3B = [
    "architectures", "attention_bias", "attention_dropout", "bos_token_id", "decoder_sparse_step", "eos_token_id",
    "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings",
    "max_window_layers", "mlp_only_layers", "model_type", "moe_intermediate_size", "norm_topk_prob",
    "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
    "output_router_logits", "rms_norm_eps", "rope_scaling", "rope_theta", "router_aux_loss_coef", "sliding_window",
    "tie_word_embeddings", "torch_dtype", "transformers_version", "use_cache", "use_sliding_window", "vocab_size",
]

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, initializer_range=0.2)


def test_every_field_of_qwen3moeconfig_is_read_refused_or_listed():
    groups = [READ, set(REFUSED), set(NO_EFFECT)]
    assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1:]), "a field in two groups"
    fields = set(transformers.Qwen3MoeConfig().to_dict()) | set(QWEN3_30B_A3B)
    missing = sorted(f for f in fields if not any(f in g for g in groups))
    assert not missing, f"fields of Qwen3MoeConfig no group names: {missing}"


@pytest.mark.parametrize("field, value", [
    ("attention_bias", True), ("hidden_act", "gelu"), ("use_sliding_window", True), ("mlp_only_layers", [0]),
    ("decoder_sparse_step", 2), ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), ("attention_dropout", 0.1),
    ("quantization_config", {"quant_method": "fp8"}),
])
def test_a_field_the_model_does_not_compute_is_refused_by_name(field, value):
    hf = transformers.Qwen3MoeConfig(**TINY).to_dict()
    check_hf_fields(hf, "c/config.json")
    with pytest.raises(ConfigError, match=rf"^c/config.json: {field} .* is not implemented here; expected "):
        MoEModelConfig.from_hf({**hf, field: value}, "c/config.json")


def test_rope_types_and_a_config_that_is_not_an_object_are_refused():
    hf = transformers.Qwen3MoeConfig(**TINY).to_dict()
    yarn = {**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}
    with pytest.raises(ConfigError, match="rope_parameters.rope_type 'yarn' is not implemented here"):
        MoEModelConfig.from_hf(yarn)
    with pytest.raises(ConfigError, match="config.json: expected a JSON object of fields, got a JSON list"):
        MoEModelConfig.from_hf([1, 2])


def test_fields_listed_as_no_effect_leave_transformers_logits_equal_to_ours(tmp_path):
    """A config.json with every NO_EFFECT field moved off its default: transformers reading it
    still computes what we load from it."""
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY)).save_pretrained(tmp_path)
    moved = dict(sliding_window=3, max_window_layers=1, intermediate_size=7, use_cache=False,
                 output_router_logits=True, router_aux_loss_coef=0.5, pad_token_id=5, bos_token_id=6,
                 eos_token_id=7, chunk_size_feed_forward=4, torch_dtype="bfloat16", problem_type="regression")
    assert set(moved) <= set(NO_EFFECT)
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **moved}))
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() < 1e-4


def test_the_export_writes_only_what_the_model_computes():
    """Every field `to_hf` writes is one the loader reads or knows, at the value it implements."""
    written = MoEModelConfig().to_hf()
    assert all(k in READ or k in REFUSED or k in NO_EFFECT for k in written), sorted(written)
    check_hf_fields(written, "export")
    assert MoEModelConfig.from_hf(written) == MoEModelConfig()
