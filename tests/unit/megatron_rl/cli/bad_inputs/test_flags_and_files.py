"""Bad input to every command (rollout, train, plan, predict, simulate, demo) is one line naming the
file, field or flag, exit 2, before any rank starts. In-process: `main()`."""
import fcntl
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.cli import main
from tests.process_tree import live_children

GOOD = '{"prompt_id": "a", "epoch": 0, "sample": 0, "prompt_len": 3, "response_len": 5}\n'
TINY_TRAIN = {
    "model": {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "num_query_groups": 1,
              "kv_channels": 8, "num_moe_experts": 4, "moe_router_topk": 1, "moe_ffn_hidden_size": 8,
              "vocab_size": 20, "max_position_embeddings": 16},
    "tokenizer": {"kind": "char", "alphabet": "0123456789+-*=() "},
    "grpo": {"group_size": 2}, "generation": {"max_response_len": 4}, "prompts_per_step": 2, "ranks": 2,
}

_HELD = []  # the lock files a test holds for "a running train"


@pytest.fixture(autouse=True)
def _release_held():
    yield
    while _HELD:
        _HELD.pop().close()


def _cases(tmp):
    def w(name, data: bytes | str):
        p = tmp / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(p)

    def train_cfg(name, rows, **changes):
        data = w(f"{name}.jsonl", rows)
        return w(f"{name}.yaml", yaml.safe_dump({**TINY_TRAIN, "data": {"path": data}, **changes}))

    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4))
    bad_char = '{"prompt": "1+x=", "answer": "1"}\n'

    def heldout_cfg(name, row, first=None):
        first = rows.splitlines(True)[0] if first is None else first
        return train_cfg(name, rows, eval={"every": 1, "path": w(f"{name}_heldout.jsonl", first + row + "\n")})

    trace = w("t.jsonl", GOOD)
    a_file = w("a_file", "x")
    latin1_trace = w("latin1.jsonl", GOOD.encode() + '{"prompt_id": "caf\xe9"}\n'.encode("latin-1"))
    latin1_yaml = w("latin1.yaml", "ranks: 2\n# caf\xe9\n".encode("latin-1"))
    broken_yaml = w("broken.yaml", "ranks: 2\nbatch: {trace: [\n")
    out = str(tmp / "out")
    loop, long = tmp / "loop1", str(tmp / ("n" * 256))  # a symlink loop; a name over 255 bytes
    loop.symlink_to(tmp / "loop2")
    (tmp / "loop2").symlink_to(loop)
    too_long = "bytes, over the file system's limit of 255"
    # a planted link in an output folder, out to a file of someone else's (every writer)
    planted, theirs = tmp / "planted", w("theirs.txt", "keep me")
    planted.mkdir()
    (planted / "report.json").symlink_to(theirs)
    (planted / "timeline.png").symlink_to(theirs)
    # a run folder a running train holds: its lock held here, as the train would
    held = tmp / "held"
    (held / "checkpoints").mkdir(parents=True)
    _HELD.append(open(held / ".flexfloor.lock", "a+", encoding="utf-8"))
    fcntl.flock(_HELD[-1], fcntl.LOCK_EX)
    return {
        # command -> [(argv, fragments of the one error line)]
        "rollout": [
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
        ],
        "train": [
            (["--config", latin1_yaml], [f"{latin1_yaml}:2: not UTF-8 text"]),
            (["--config", train_cfg("latin1_data", rows.encode() + '{"prompt": "caf\xe9"}\n'.encode("latin-1"))],
             ["latin1_data.jsonl:5: not UTF-8 text (byte 0xe9 at file offset"]),
            (["--config", train_cfg("small", rows, prompts_per_step=8)],
             ["small.jsonl: 4 usable prompts, fewer than one step's prompts_per_step (8)"]),
            (["--config", train_cfg("alphabet", rows + '{"prompt": "1+x=", "answer": "1"}\n')],
             ["alphabet.jsonl:5: character 'x'"]),
            (["--config", train_cfg("noprompt", rows + '{"question": "2+2=", "answer": "4"}\n')],
             ["noprompt.jsonl:5: missing prompt field 'prompt'"]),
            (["--config", train_cfg("long", rows + json.dumps({"prompt": "1+" * 8 + "1=", "answer": "9"}) + "\n")],
             ["long.jsonl:5: prompt of 19 tokens", "exceeds model.max_position_embeddings (16)"]),
            # held-out prompts (eval.path) go through the training data's checks
            (["--config", heldout_cfg("ho_long", json.dumps({"prompt": "1+" * 8 + "1=", "answer": "9"}))],
             ["ho_long_heldout.jsonl:2: prompt of 19 tokens", "exceeds model.max_position_embeddings (16)"]),
            (["--config", heldout_cfg("ho_char", '{"prompt": "1+x=", "answer": "1"}')],
             ["ho_char_heldout.jsonl:2: character 'x'"]),
            (["--config", heldout_cfg("ho_noans", '{"prompt": "1+1="}', first="")],
             ["ho_noans_heldout.jsonl: no row has a reference answer"]),
            # ... and so do the warm start's own prompts (warmstart.path)
            (["--config", train_cfg("ws", rows, warmstart={"sft_steps": 1, "path": w("wsx.jsonl", rows + bad_char)})],
             ["wsx.jsonl:5: character 'x'"]),
            (["--config", train_cfg("ws1", rows, warmstart={"sft_steps": 1, "path": w("ws1_sft.jsonl", rows[:33])})],
             ["ws1_sft.jsonl: 1 prompts with an answer to learn from, fewer than the 2 ranks"]),
            (["--config", train_cfg("ok", rows), "--out", a_file], [f"--out {a_file}: exists and is not a folder"]),
            (["--config", train_cfg("ok2", rows), "--out", out, "--json", str(tmp / "nope" / "s.json")],
             [f"--json {tmp / 'nope' / 's.json'}: folder {tmp / 'nope'} does not exist"]),
            (["--config", train_cfg("ok3", rows), "--out", str(loop)], [f"--out {loop}: a symlink loop"]),
            (["--config", train_cfg("ok4", rows), "--out", out, "--json", str(loop)],
             [f"--json {loop}: a symlink loop"]),
            (["--config", train_cfg("ok5", rows), "--out", long], [too_long]),
            (["--config", train_cfg("meg", rows, backend="megatron"), "--policy", "adaptive"],
             ["--policy adaptive: elastic.policy adaptive: its ladder of stages needs arbitrary expert ownership"]),
        ],
        "plan": [
            (["--trace", trace, "--max-response-len", "-5"], ["--max-response-len -5: max_response_len: expected > 0"]),
            (["--trace", trace, "--max-response-len", "0"], ["--max-response-len 0: max_response_len: expected > 0"]),
            (["--trace", trace, "--ranks", "1000"], ["--ranks 1000: ranks: expected at most the experts of"]),
            (["--trace", latin1_trace], [f"{latin1_trace}:2: not UTF-8 text"]),
            (["--trace", trace, "--ranks", "8", "--floor", "0"], ["floor: expected 1..ranks"]),
            (["--trace", trace, "--ranks", "8", "--epoch", "0"], ["--max-response-len"]),
            (["--trace", trace, "--ranks", "8", "--epoch", "7"], ["no records for epoch 7"]),
        ],
        "predict": [
            (["--trace", latin1_trace], [f"{latin1_trace}:2: not UTF-8 text"]),
            (["--trace", trace, "--alpha", "2"], ["--alpha: expected a value in (0, 1)"]),
            (["--trace", trace], ["needs at least two epochs"]),
        ],
        "simulate": [
            (["--trace", latin1_trace], [f"{latin1_trace}:2: not UTF-8 text"]),
            (["--trace", trace, "--cost", latin1_yaml], [f"{latin1_yaml}:2: not UTF-8 text"]),
            (["--trace", trace, "--plot", a_file], [f"--plot {a_file}: exists and is not a folder"]),
            (["--trace", trace, "--plot", str(loop)], [f"--plot {loop}: a symlink loop"]),
            (["--trace", trace, "--plot", str(planted)], [f"--plot {planted}: report.json: a symlink to"]),
            (["--trace", trace, "--plot", f"{long}/figs"], [too_long]),
            (["--trace", trace, "--floor", "0"], ["--floor 0: floor: expected 1..ranks (16)"]),
            (["--trace", "missing.jsonl"], ["missing.jsonl"]),
            (["--trace", trace, "--epochs", "0"], ["--epochs"]),
            (["--trace", trace, "--cost", w("cost.yaml", "step_overhead: 0.01\n")], ["cost.yaml", "step_overhead"]),
        ],
        "demo": [
            (["--ranks", "3"], ["--ranks 3:", "expected a multiple of ranks (3)"]),
            (["--config", latin1_yaml], [f"{latin1_yaml}:2: not UTF-8 text"]),
            (["batch.prompts=many"], ["batch.prompts=many: batch.prompts: expected an integer"]),
        ],
    }


@pytest.mark.parametrize("command", ["rollout", "train", "plan", "predict", "simulate", "demo"])
def test_bad_input_is_one_line_exit_2_before_any_rank(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, fragments in _cases(tmp_path)[command]:
        rc = main([command, *argv])
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (argv, rc, err[-2000:])
        assert lines[0].startswith(f"flexfloor {command}: error: "), (argv, lines)
        for f in fragments:
            assert f in lines[0], (argv, f, lines[0])
        assert "[rollout]" not in err and "[train] step" not in err
        assert not live_children(), (argv, "a process of the run is still alive")
    sys.stdout.flush()


def test_offload_without_a_working_deepspeed_is_one_line_before_any_rank(tmp_path, capsys, monkeypatch):
    """Issue 31 defect 21: `optim.offload: cpu` with DeepSpeed missing, or its CPU Adam failing to
    JIT-build, is one line on the driver; a failed build shows the compiler's last error lines."""
    import types

    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4))
    (tmp_path / "d.jsonl").write_text(rows)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**TINY_TRAIN, "data": {"path": str(tmp_path / "d.jsonl")}, "dtype": "float32",
                                   "optim": {"offload": "cpu"}}))
    argv = ["train", "--config", str(cfg), "--out", str(tmp_path / "out")]

    def one_line(*fragments):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and all(f in lines[0] for f in fragments), lines
        assert not live_children()

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    one_line("optim.offload: cpu needs deepspeed (pip install deepspeed); importing it failed: ")

    class Builder:
        def load(self, verbose=False):
            raise RuntimeError("Error building extension 'cpu_adam': [1/3] c++ -c cpu_adam.cpp -O3\n"
                               "FAILED: cpu_adam.o\ncpu_adam.cpp:12:5: error: 'simd_load' was not declared\n"
                               "cpu_adam.cpp:40:1: error: expected ';' before '}' token\n"
                               "ninja: build stopped: subcommand failed.\n")

    for name in ("deepspeed", "deepspeed.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "deepspeed.ops.op_builder", types.SimpleNamespace(CPUAdamBuilder=Builder))
    one_line("optim.offload: cpu: DeepSpeed's CPU Adam did not build (RuntimeError: cpu_adam.cpp:12:5: error: "
             "'simd_load' was not declared | cpu_adam.cpp:40:1: error: expected ';' before '}' token)")


def test_sft_warmstart_replaces_only_its_own_export(tmp_path, capsys):
    """Issue 31: `tools/sft_warmstart.py --out` exports under `export --to`'s rule: a non-empty
    folder that is not a FlexFloor export (a base model, `.`) is refused before any rank starts,
    and left as it was (it was replaced whole)."""
    import runpy

    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4))
    (tmp_path / "d.jsonl").write_text(rows)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**TINY_TRAIN, "data": {"path": str(tmp_path / "d.jsonl")},
                                   "warmstart": {"sft_steps": 1}}))
    theirs = tmp_path / "base_model"
    theirs.mkdir()
    (theirs / "config.json").write_text("{}")
    sys.argv = ["sft_warmstart.py", "--config", str(cfg), "--out", str(theirs)]
    with pytest.raises(SystemExit) as stop:
        runpy.run_path("tools/sft_warmstart.py", run_name="__main__")
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"sft_warmstart: error: --out {theirs}: "
                             "is a non-empty folder that is not a FlexFloor export")
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json"] and not live_children()


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
        "trace_bad_json": (trace("t1.jsonl", good + "{oops\n"), ["t1.jsonl:2:", "not valid JSON"]),
        "trace_missing_field": (trace("t2.jsonl", good + '{"prompt_id": "b", "epoch": 0, "sample": 0}\n'),
                                ["t2.jsonl:2:", "missing field 'prompt_len'"]),
        "trace_negative_length": (trace("t3.jsonl", good.replace('"response_len": 5', '"response_len": -5')),
                                  ["t3.jsonl:1:", "'response_len': expected >= 0", "-5"]),
    }


CASES = ["unknown_key", "wrong_type", "experts_not_divisible", "more_ranks_than_experts",
         "checkpoint_empty_dir", "checkpoint_is_a_file", "checkpoint_torn_safetensors",
         "checkpoint_missing_tensor", "checkpoint_other_model", "trace_bad_json", "trace_missing_field",
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
