"""HuggingFace `transformers` is the oracle for the Qwen3-MoE architecture."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_rl.errors import FlexFloorError  # noqa: E402
from megatron_rl.models import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from megatron_rl.rollout.engine import Request, RolloutEngine  # noqa: E402
from megatron_rl.rollout.sampling import SamplingParams  # noqa: E402


def tiny_hf(norm_topk_prob=True, tie=False):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        tie_word_embeddings=tie, initializer_range=0.2)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "pre_softmax"])
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    model = tiny_hf(norm_topk_prob=request.param)
    model.save_pretrained(path)
    return model, path


def test_logits_match_hf(saved):
    hf, path = saved
    ours = load_hf_checkpoint(path, dtype=torch.float32)
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
    assert got.shape == (3, 17, 96)
    assert (want - got).abs().max().item() < 1e-4


def test_greedy_tokens_match_hf_generate(saved):
    hf, path = saved
    ours = load_hf_checkpoint(path, dtype=torch.float32)
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    want = hf.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                       pad_token_id=0)[0, 9:].tolist()
    eng = RolloutEngine(ours, SamplingParams(greedy=True), max_batch=4, max_len=64)
    eng.add([Request("p", 0, prompt[0].tolist(), max_new_tokens=32)])
    while eng.has_work():
        eng.step()
    assert eng.finished[0].tokens == want


def test_fused_expert_layout_and_export_roundtrip(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    hf, path = saved
    # Rewrite the checkpoint in the fused in-memory layout (gate_up_proj [E, 2F, D], down_proj).
    sd = load_file(str(path / "model.safetensors"))
    fused = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    for i in range(2):
        pre = f"model.layers.{i}.mlp.experts."
        fused[pre + "gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{pre}{e}.gate_proj.weight"], sd[f"{pre}{e}.up_proj.weight"]]) for e in range(8)])
        fused[pre + "down_proj"] = torch.stack([sd[f"{pre}{e}.down_proj.weight"] for e in range(8)])
    fdir = tmp_path / "fused"
    fdir.mkdir()
    save_file(fused, str(fdir / "model.safetensors"))
    (fdir / "config.json").write_text((path / "config.json").read_text())
    a, b = load_hf_checkpoint(path), load_hf_checkpoint(fdir)
    ids = torch.arange(12)[None]
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))
    # Export back and reload: bit-identical, and HF reads our export.
    out = tmp_path / "export"
    save_hf_checkpoint(b, out)
    with torch.no_grad():
        assert torch.equal(load_hf_checkpoint(out)(ids), a(ids))
        again = transformers.Qwen3MoeForCausalLM.from_pretrained(out).eval()
        assert (again(ids).logits - hf(ids).logits).abs().max().item() < 1e-5


def test_partial_experts_load(saved):
    _, path = saved
    m = load_hf_checkpoint(path, experts=[2, 3])
    assert m.moe_layers[0].experts.held() == [2, 3]


def test_unreadable_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FlexFloorError, match="config.json: cannot read checkpoint config"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf().config.to_dict()))
    with pytest.raises(FlexFloorError, match="no \\*.safetensors files"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(FlexFloorError, match="unreadable safetensors file"):
        load_hf_checkpoint(tmp_path)


def test_sharded_export_with_index_rope_theta_and_generation_config(tmp_path):
    """Shards of at most `shard_bytes`, an index listing every tensor exactly
    once, rope_theta 1e6 for a transformers 4.x reader (the field it reads alone), the bos/eos ids
    and generation_config.json; transformers loads the sharded export to the same logits."""
    from safetensors import safe_open

    from megatron_rl.models import MoEModelConfig, Qwen3MoeModel

    cfg = MoEModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                         num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, vocab_size=96)
    ours = Qwen3MoeModel(cfg)
    ours.init_weights(0)
    out = tmp_path / "sharded"
    save_hf_checkpoint(ours, out, shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    held, total = [], 0
    for f in files:
        with safe_open(str(out / f), framework="pt") as h:
            held += [(k, f) for k in h.keys()]
            nbytes = sum(h.get_tensor(k).numel() * 4 for k in h.keys())
            assert nbytes <= 20_000 or len(list(h.keys())) == 1
            total += nbytes
    assert sorted(held) == sorted(index["weight_map"].items())  # every tensor once, where the index says
    assert len({k for k, _ in held}) == len(held) and index["metadata"]["total_size"] == total
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 1e6 and config["rope_parameters"]["rope_theta"] == 1e6
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    ids = torch.arange(12)[None]
    with torch.no_grad():
        again = transformers.Qwen3MoeForCausalLM.from_pretrained(out).eval()
        assert (again(ids).logits - ours(ids)).abs().max().item() < 1e-4
    # A 4.x reader knows only `rope_theta`: with it alone, the RoPE base is still 1e6.
    del config["rope_parameters"]
    (out / "config.json").write_text(json.dumps(config))
    read = transformers.AutoConfig.from_pretrained(out)
    theta = getattr(read, "rope_theta", None) or read.rope_parameters["rope_theta"]
    assert theta == 1e6


def test_deep_or_outside_index_and_config_are_one_line(tmp_path):
    """The JSON depth cap, where HF JSON is read: a nested config.json or index was a
    RecursionError traceback; an index naming a file outside the folder is refused."""
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FlexFloorError, match="config.json: not valid JSON \\(nested deeper than 64"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf().config.to_dict()))
    for index in ("[" * 100_000 + "]" * 100_000, json.dumps({"weight_map": {"a": "../../etc/passwd"}})):
        (tmp_path / "model.safetensors.index.json").write_text(index)
        with pytest.raises(FlexFloorError, match="model.safetensors.index.json: unreadable index"):
            load_hf_checkpoint(tmp_path)


def test_hf_shapes_are_what_transformers_holds_and_what_our_export_writes(saved):
    """`hf_shapes` describes the checkpoint from config.json alone: transformers' in-memory (fused)
    tensors and the per-expert files it saves, and, name for name in order, our export's layout."""
    from safetensors import safe_open

    from megatron_rl.models import Qwen3MoeModel
    from megatron_rl.models.hf import hf_shapes, megatron_to_hf, read_hf_config

    hf, path = saved
    cfg = read_hf_config(path)
    assert hf_shapes(cfg, fused_layers=range(cfg.num_layers)) == {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        assert hf_shapes(cfg) == {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
    with torch.device("meta"):
        ours = megatron_to_hf(Qwen3MoeModel(cfg).state_dict(), cfg)
    assert list(hf_shapes(cfg).items()) == [(k, tuple(v.shape)) for k, v in ours.items()]


def test_a_tensor_of_another_shape_is_refused_from_its_header(saved, tmp_path):
    """A k_proj of the right size but the wrong shape would reshape silently into the fused QKV:
    the check (and the load) name the tensor, before any tensor data is read."""
    from safetensors.torch import load_file, save_file

    from megatron_rl.models.hf import check_hf_checkpoint

    _, path = saved
    sd = load_file(str(path / "model.safetensors"))
    k = "model.layers.1.self_attn.k_proj.weight"
    sd[k] = sd[k].reshape(32, 16)
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    said = f"tensor {k} has shape \\(32, 16\\), config.json implies \\(16, 32\\)"
    for check in (check_hf_checkpoint, load_hf_checkpoint):
        with pytest.raises(FlexFloorError, match=said):
            check(tmp_path)
