"""`flexfloor rollout`: bad configs, flags, checkpoints, traces and output folders are one line
naming the file, field or flag, exit 2, before any rank starts. In-process: `main()`."""
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.models import MoEModelConfig, Qwen3MoeModel, load_hf_checkpoint, save_hf_checkpoint
from tests.process_tree import live_children
from tests.process_tree import one_line_exit_2 as _one_line_exit_2


def test_bad_input_is_one_line_exit_2_before_any_rank(files, refuses_each):
    latin1_yaml, latin1_trace, broken_yaml, a_file, loop, long, too_long, planted, theirs, held, tmp = (
        files.latin1_yaml, files.latin1_trace, files.broken_yaml, files.a_file, files.loop, files.long, files.too_long,
        files.planted, files.theirs, files.held, files.tmp)
    refuses_each("rollout", [
        (["--config", latin1_yaml], [f"{latin1_yaml}:2: not UTF-8 text (byte 0xe9 at file offset 14)"]),
        (["--trace", latin1_trace], [f"{latin1_trace}:2: not UTF-8 text (byte 0xe9 at file offset"]),
        (["--config", broken_yaml], [f"{broken_yaml}:3:1: not valid YAML"]),
        (["--ranks", "0"], ["--ranks 0: ranks: expected > 0, got 0"]),
        # adaptive's ladder needs the torch backend's ownership: refused at config load, for every command
        (["backend=megatron", "--policy", "adaptive"], ["policy adaptive: its ladder of stages needs arbitrary"]),
        (["--out", a_file], [f"--out {a_file}: exists and is not a folder"]),
        (["--out", f"{a_file}/sub"], [f"--out {a_file}/sub: cannot create the folder (Not a directory)"]),
        (["--out", "/proc/flexfloor-test"], ["--out /proc/flexfloor-test: cannot create the folder"]),
        (["--json", str(tmp / "missing" / "r.json")], [f"folder {tmp / 'missing'} does not exist"]),
        # one line before the rollout, not an OSError after it
        (["--json", str(loop)], [f"--json {loop}: a symlink loop"]),
        (["--json", f"{long}.json"], [too_long]),
        (["--out", f"{loop}/sub"], [f"--out {loop}/sub: a symlink loop"]),
        (["--out", long], [too_long]),
        (["--out", str(planted)], [f"--out {planted}: report.json: a symlink to {theirs}, outside"]),
        (["--plot", str(planted)], [f"--plot {planted}: report.json: a symlink to {theirs}, outside"]),
        (["--json", str(held / "metrics.jsonl")], [f"--json {held / 'metrics.jsonl'}: is inside the run "
                                                   f"folder {held}, in use by"]),
        (["--out", str(held / "rollout")], [f"--out {held / 'rollout'}: is inside the run folder {held}"]),
    ])


# (override, what the one line names): see `refuses_value`.
BAD_VALUES = [
    ("max_batch_per_rank=0", "max_batch_per_rank: expected > 0"),
    ("batch.prompts=100000000", "batch.prompts x samples x epochs: expected an integer in [1, 2^24]"),
    ("sampling.seed=-1", "sampling.seed: expected an integer in [0, 2^32)"),
    ("fault=bogus", "expected one of 'kill-leased-rank', 'fail-transfer', 'stuck-lease' or null"),
    # passed the config on a 4096-position model, then failed allocating in the ranks
    ("kv_page_size=16777216", "kv_page_size: expected at most model.max_position_embeddings (4096"),
]


@pytest.mark.parametrize("override,expect", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_a_value_that_would_hang_or_crash_is_one_line(refuses_value, override, expect):
    refuses_value(["rollout", "--ranks", "2"], override, expect)


def test_a_rollout_into_a_folder_in_use_is_refused(tmp_path, capsys):
    from megatron_rl.files.out_lock import hold_out_dir

    with hold_out_dir(tmp_path, "train"):
        _one_line_exit_2(capsys, ["rollout", "--ranks", "2", "--out", tmp_path, "--quiet"],
                         f"--out {tmp_path}: in use by pid {os.getpid()} (`flexfloor train`, started ")
    assert not (tmp_path / "config.yaml").exists()


# Rollout inputs that reach the model: configs, checkpoints, traces.
def _tiny_checkpoint(path: Path) -> Path:
    import torch

    from megatron_rl.models import MoEModelConfig, Qwen3MoeModel, save_hf_checkpoint

    model = Qwen3MoeModel(MoEModelConfig(), dtype=torch.float32)
    model.init_weights(0)
    save_hf_checkpoint(model, path)
    return path


def _bad_inputs(tmp: Path) -> dict[str, tuple[list, list[str]]]:
    """name -> (CLI arguments, fragments the one error line must contain)."""
    def write(name, text):
        (tmp / name).write_text(text)
        return tmp / name

    good = '{"prompt_id": "a", "epoch": 0, "sample": 0, "prompt_len": 3, "response_len": 5}\n'
    empty = tmp / "empty_ckpt"
    empty.mkdir()
    garbage = write("garbage.bin", "not a checkpoint")
    torn = shutil.copytree(_tiny_checkpoint(tmp / "ckpt"), tmp / "torn_ckpt")
    (torn / "model.safetensors").write_bytes(b"\x00" * 4)
    incomplete = shutil.copytree(tmp / "ckpt", tmp / "incomplete_ckpt")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(incomplete / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(incomplete / "model.safetensors"))
    biased = shutil.copytree(tmp / "ckpt", tmp / "biased_ckpt")  # loaded, the bias tensors were dropped
    (biased / "config.json").write_text((biased / "config.json").read_text().replace(
        '"attention_bias": false', '"attention_bias": true'))

    def cfg(name, text):
        return ["--config", write(name, text)]

    def trace(name, text):
        return ["--trace", write(name, text)]

    return {
        "unknown_key": (cfg("unknown.yaml", "ranks: 2\nbatch:\n  lenght_scale: 0.1\n"),
                        ["unknown.yaml.batch: unknown field 'lenght_scale'"]),
        "wrong_type": (cfg("wrong_type.yaml", "model:\n  num_layers: two\n"),
                       ["wrong_type.yaml.model.num_layers", "expected an integer", "'two'"]),
        "experts_not_divisible": (["--ranks", 3], ["model.num_moe_experts: expected a multiple of ranks (3), got 8"]),
        "more_ranks_than_experts": (["--ranks", 16],
                                    ["ranks: expected at most 8 (the model's experts in model.num_moe_experts"]),
        "checkpoint_empty_dir": (cfg("c1.yaml", f"checkpoint: {empty}\n"),
                                 [f"{empty}/config.json", "cannot read checkpoint config"]),
        "checkpoint_is_a_file": (cfg("c2.yaml", f"checkpoint: {garbage}\n"),
                                 [str(garbage), "expected a HuggingFace checkpoint directory"]),
        "checkpoint_torn_safetensors": (cfg("c3.yaml", f"checkpoint: {torn}\n"),
                                        [f"{torn}/model.safetensors", "unreadable safetensors file"]),
        "checkpoint_missing_tensor": (cfg("c4.yaml", f"checkpoint: {incomplete}\n"),
                                      ["'model.layers.1.mlp.experts.5.up_proj.weight' is missing"]),
        "checkpoint_other_model": (cfg("c5.yaml", f"checkpoint: {tmp / 'ckpt'}\nmodel:\n  num_layers: 3\n"),
                                   [f"{tmp / 'ckpt'}: checkpoint is for another model shape",
                                    "num_layers: checkpoint 2, model: 3"]),
        "checkpoint_not_implemented": (cfg("c7.yaml", f"checkpoint: {biased}\n"),
                                       [f"{biased}/config.json: attention_bias true is not implemented here"]),
        # the checkpoint's positions decide (its config.json says 4096)
        "checkpoint_page_past_positions": (cfg("c6.yaml", f"checkpoint: {tmp / 'ckpt'}\nkv_page_size: 8192\n"),
                                           ["kv_page_size: expected at most model.max_position_embeddings (4096"]),
        "trace_bad_json": (trace("t1.jsonl", good + "{oops\n"), ["t1.jsonl:2:", "not valid JSON"]),
        "trace_missing_field": (trace("t2.jsonl", good + '{"prompt_id": "b", "epoch": 0, "sample": 0}\n'),
                                ["t2.jsonl:2:", "missing field 'prompt_len'"]),
        "trace_negative_length": (trace("t3.jsonl", good.replace('"response_len": 5', '"response_len": -5')),
                                  ["t3.jsonl:1:", "'response_len': expected >= 0", "-5"]),
    }


CASES = ["unknown_key", "wrong_type", "experts_not_divisible", "more_ranks_than_experts",
         "checkpoint_empty_dir", "checkpoint_is_a_file", "checkpoint_torn_safetensors",
         "checkpoint_missing_tensor", "checkpoint_other_model", "checkpoint_page_past_positions",
         "checkpoint_not_implemented",
         "trace_bad_json", "trace_missing_field",
         "trace_negative_length"]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    return _bad_inputs(tmp_path_factory.mktemp("bad"))


@pytest.mark.parametrize("case", CASES)
def test_bad_rollout_input_is_one_line_exit_2_before_any_rank_starts(bad_inputs, case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, fragments = bad_inputs[case]
    rc = main(["rollout", "--ranks", "2", *map(str, args)])  # a later --ranks in `args` wins
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("flexfloor rollout: error: "), (rc, err[-2000:])
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert "[rollout]" not in err and out == "" and not live_children()  # failed before spawning ranks


def test_bad_cases_cover_every_fixture(bad_inputs):
    assert sorted(bad_inputs) == sorted(CASES)


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
