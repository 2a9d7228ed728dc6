"""Issue 23 items 6 and 12: weights that overflow the run's dtype, and the run folder's own files
(trainer_state.json, latest, wandb_run.json) when corrupt: each one line naming the file."""
import json

import pytest
import torch

from megatron_rl.errors import FlexFloorError
from megatron_rl.models import MoEModelConfig, Qwen3MoeModel, load_hf_checkpoint, save_hf_checkpoint
from megatron_rl.rl.checkpoint import CheckpointError, latest_checkpoint, read_state_json

TINY = MoEModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                      kv_channels=8, num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=8, vocab_size=20)


def test_a_weight_that_overflows_the_run_dtype_is_named_after_the_cast(tmp_path):
    model = Qwen3MoeModel(TINY, dtype=torch.float64)
    model.init_weights(0)
    name, param = next((n, p) for n, p in model.named_parameters() if "linear_qkv" in n)
    with torch.no_grad():
        param[0, 0] = 1e300  # finite in float64, inf in float32
    save_hf_checkpoint(model, tmp_path / "ckpt")
    kept = dict(load_hf_checkpoint(tmp_path / "ckpt", torch.float64).named_parameters())[name]
    assert kept[0, 0].item() == 1e300 and torch.equal(kept, param)  # float64 holds it: no error, no change
    from megatron_rl.models.hf import CheckpointError as HFCheckpointError

    with pytest.raises(HFCheckpointError, match=r"holds 1 value\(s\) \(largest 1e\+300\) that overflow float32 "
                                              r"\(max 3.4e\+38\)"):
        load_hf_checkpoint(tmp_path / "ckpt", torch.float32)


@pytest.mark.parametrize("content", [b"\xff\xfe", b"[1, 2]", b'{"step": "3", "model": {}, "data": {}}',
                                     b"[" * 100_000, b'{"step": 1}'])
def test_a_corrupt_trainer_state_is_one_line(tmp_path, content):
    (tmp_path / "trainer_state.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'trainer_state.json'}: ") as e:
        read_state_json(tmp_path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize("content", [b"\xff\x00\x01", b"../../etc", b"step_1 rm -rf"])
def test_a_latest_pointer_that_names_no_step_is_one_line(tmp_path, content):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match="latest: ") as e:
        latest_checkpoint(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content", [b"\xff", b"[]", b'{"id": 3}', b"{" * 50_000])
def test_a_bad_wandb_run_json_is_one_line(tmp_path, content):
    from megatron_rl.metrics import read_run_state

    (tmp_path / "wandb_run.json").write_bytes(content)
    with pytest.raises(FlexFloorError, match="wandb_run.json: unreadable"):
        read_run_state(tmp_path / "wandb_run.json")
    (tmp_path / "wandb_run.json").write_text(json.dumps({"id": "ab12", "last_step": 3}))
    assert read_run_state(tmp_path / "wandb_run.json") == {"id": "ab12", "last_step": 3}


# ---- the `partial` section of trainer_state.json (issue 31, defects 4, 19, 20, 26) ---------------
def _partial_resume(tmp_path, section: dict, step: int = 1, **changes):
    """check_partial_resume of `section` against the tiny example with partial on, group_size 2."""
    from megatron_rl.config import load_dataclass
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.data.tokenizer import build_tokenizer
    from megatron_rl.rl.partial_state import check_partial_resume
    from megatron_rl.trainer_config import TrainerConfig

    overrides = {"partial.enabled": True, "grpo.group_size": 2, **changes}
    cfg = load_dataclass(TrainerConfig, "examples/tiny_cpu_grpo.yaml", overrides)
    data = load_prompts(cfg.data)
    check_partial_resume(cfg, data, build_tokenizer(cfg.tokenizer), tmp_path, {"step": step, "partial": section})


def _section() -> dict:
    """What PartialRollouts.state_dict() writes: one pending group (row 3, uid 1) of 2 samples, one
    complete, one carried, and one drawn prompt not yet launched."""
    samples = [{"prompt_id": "arith-00003", "sample": j, "prompt_len": 5, "rid": 2 + j, "n": 2, "done": j == 0,
                "segments": [[1, 2]], "tokens": [5, 6], "logprobs": [-1.0, -2.5]} for j in range(2)]
    return {"queue": [[7, 0]], "pool": {"next_uid": 2, "trained": 1, "pending": [
        {"uid": 1, "prompt_id": "arith-00003", "payload": {"index": 3, "epoch": 0}, "samples": samples}]}}


def _set(section: dict, path: str, value):
    node, *keys = section, *path.split("/")
    for k in keys[:-1]:
        node = node[int(k) if k.isdigit() else k]
    last = keys[-1]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return section


G0 = "pool/pending/0"
S1 = f"{G0}/samples/1"


@pytest.mark.parametrize("path, value, expect", [
    ("queue", "abc", "partial.queue: expected list, got str"),
    ("pool", KeyError, "partial.pool: expected dict, got NoneType"),
    ("queue/0/0", 10**6, "partial.queue[0][0] (data index; the dataset has 400 prompts): "
                         "expected an integer in [0, 400), got 1000000"),
    (f"{G0}/payload/index", 10**6, "partial.pool.pending[0].payload.index (the dataset has 400 prompts)"),
    (f"{G0}/payload/epoch", -1, "partial.pool.pending[0].payload.epoch: expected an integer in [0, inf), got -1"),
    (f"{S1}/logprobs/1", "x", "partial.pool.pending[0].samples[1].logprobs[1]: expected a finite log-probability"),
    (f"{S1}/logprobs/0", float("nan"), "samples[1].logprobs[0]: expected a finite log-probability <= 0, got nan"),
    (f"{S1}/logprobs/0", 0.5, "samples[1].logprobs[0]: expected a finite log-probability <= 0, got 0.5"),
    (f"{S1}/tokens/1", 20, "samples[1].tokens[1] (model.vocab_size is 20): expected an integer in [0, 20), got 20"),
    (f"{S1}/tokens/0", True, "samples[1].tokens[0] (model.vocab_size is 20): expected int, got bool"),
    (f"{S1}/tokens", [5], "samples[1]: expected n 2 tokens and log-probs, got 1 and 2"),
    (f"{S1}/segments", [[2, 2]], "samples[1].segments[0][0] (policy version; checkpoint step 1): "
                                 "expected an integer in [1, 2), got 2"),
    (f"{S1}/segments", [[1, 1]], "samples[1].segments: expected n 2 tokens, got 1"),
    (f"{S1}/rid", 7, "samples[1].rid: expected 3 (its group's), got 7"),
    (f"{S1}/done", "no", "samples[1].done: expected bool, got str"),
    (f"{G0}/uid", 2, "partial.pool.pending[0].uid: expected an integer in [0, 2), got 2"),
    (f"{G0}/prompt_id", "arith-00004", "prompt_id: expected 'arith-00003' (row 3 of examples/data/arith_train.jsonl), "
                                      "got 'arith-00004' (the dataset changed since the checkpoint)"),
    (f"{G0}/samples", [], "samples: expected a group of grpo.group_size 2 samples, got 0"),
    ("pool/trained", 3, "partial.pool: expected trained + pending groups = the 2 launched, got 3 trained + 1 pending"),
])
def test_a_bad_partial_section_is_one_line_naming_file_and_field(tmp_path, path, value, expect):
    with pytest.raises(CheckpointError) as e:
        _partial_resume(tmp_path, _set(_section(), path, value))
    assert str(e.value).startswith(f"{tmp_path / 'trainer_state.json'}: partial") and expect in str(e.value)
    assert "\n" not in str(e.value)


def test_a_partial_section_that_does_not_fit_the_config_is_refused_before_the_ranks(tmp_path, capsys):
    _partial_resume(tmp_path, _section())  # the well-formed section passes
    twice = _section()
    twice["pool"]["pending"].append(twice["pool"]["pending"][0])
    with pytest.raises(CheckpointError, match=r"pending\[1\].uid: group 1 is listed twice"):
        _partial_resume(tmp_path, twice)
    with pytest.raises(CheckpointError, match=r"expected a group of grpo.group_size 4 samples, got 2; resume with "
                                              r"grpo.group_size=2"):
        _partial_resume(tmp_path, _section(), **{"grpo.group_size": 4})
    # the carried sample has 2 tokens: with max_response_len 2 it could generate none
    with pytest.raises(CheckpointError, match=r"samples\[1\].n \(generation.max_response_len is 2\): "
                                              r"expected an integer in \[0, 2\), got 2"):
        _partial_resume(tmp_path, _section(), **{"generation.max_response_len": 2})
    _partial_resume(tmp_path, _section(), **{"generation.max_response_len": 3})
    # partial off: the carried work is refused, or dropped and counted when asked
    with pytest.raises(CheckpointError, match=r"partial: 1 carried groups and 1 drawn prompts not yet launched "
                                              r"from a partial run; resume with partial.enabled=true"):
        _partial_resume(tmp_path, _section(), **{"partial.enabled": False})
    _partial_resume(tmp_path, _section(), **{"partial.enabled": False, "partial.drop_carried": True})
    assert "dropping 1 carried groups and 1 drawn prompts not yet launched (partial.drop_carried=true)" in \
        capsys.readouterr().err
    empty = {"queue": [], "pool": {"next_uid": 2, "trained": 2, "pending": []}}
    _partial_resume(tmp_path, empty, **{"partial.enabled": False})  # nothing carried: nothing to refuse


def test_carried_routes_are_checked_on_the_driver_too(tmp_path):
    """The carried routes (routing replay) are refused before any rank starts, as the rest of the section."""
    from megatron_rl.models.routes import encode

    ok = torch.zeros(5 + 2 - 1, 2, 2, dtype=torch.uint8)  # prompt 5 + 2 tokens - 1 positions, L 2, top-2
    _partial_resume(tmp_path, {**_section(), "routes": [["arith-00003", 3, encode(ok)]]})
    bad = ok.clone()
    bad[0, 0, 0] = 8  # the tiny model has 8 experts
    with pytest.raises(CheckpointError, match=r"trainer_state.json: field partial.routes\[0\]: expert id 8 outside"):
        _partial_resume(tmp_path, {**_section(), "routes": [["arith-00003", 3, encode(bad)]]})
    with pytest.raises(CheckpointError, match=r"partial.routes\[0\]: response \('arith-00009', 0\) is not pending"):
        _partial_resume(tmp_path, {**_section(), "routes": [["arith-00009", 0, encode(ok)]]})


@pytest.mark.parametrize("saved, dtype", [(torch.float64, "bfloat16"), (torch.bfloat16, "float32")])
def test_a_dtype_change_on_resume_is_refused_before_the_ranks(tmp_path, saved, dtype):
    """Issue 31 defect 27: refused on the driver naming both dtypes (was an internal key name, late)."""
    import torch.distributed.checkpoint as dcp

    from megatron_rl.rl.resume_fit import check_resume_dtype

    dcp.save({"model": {"w": torch.zeros(2, dtype=saved)}, "optim": {"x": torch.zeros(1)}},
             checkpoint_id=str(tmp_path), no_dist=True)
    name = str(saved).removeprefix("torch.")
    check_resume_dtype(tmp_path, name)
    with pytest.raises(CheckpointError, match=f"saved in {name}, config dtype {dtype}; a run resumes in the dtype "
                                              f"it was saved in \\(set dtype: {name}\\)"):
        check_resume_dtype(tmp_path, dtype)
