"""`flexfloor rollout` as a user runs it: a subprocess, its files, its exit status, its stderr."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wandb_history, wandb_records

from tests.helpers import REPO
from tests.helpers.cli import cli

STATES = {"busy", "dummy", "transition", "leased", "idle"}
pytestmark = pytest.mark.timeout(240)


def test_rollout_writes_report_json_and_out_dir(tailed_trace, tmp_path):
    out_json, out_dir = tmp_path / "report.json", tmp_path / "run"
    # Long enough (~1-3 s) that the ranks' clock skew stays well inside the ledger's 1% check.
    r = cli("rollout", "--trace", tailed_trace, "--ranks", 2, "--length-scale", 0.02,
            "--json", out_json, "--out", out_dir, "--wandb", "t")
    assert r.returncode == 0, r.stderr
    assert "[rollout]" in r.stderr and "unfinished 0" in r.stderr  # the progress line
    assert "dummy share" in r.stdout and "responses_sha256" in r.stdout
    report = json.loads(out_json.read_text())
    assert report["ranks"] == 2 and report["rollout_time_s"] > 0
    assert set(report["rank_seconds"]) == STATES and set(report["rank_steps"]) == STATES
    assert sum(report["rank_steps"].values()) == 2 * report["rollout_steps"]
    assert report["tokens_per_occupied_rank_s"] > 0
    assert json.loads((out_dir / "report.json").read_text()) == report
    assert json.loads((out_dir / "plan.json").read_text())["ranks"] == 2
    lines = (out_dir / "responses.jsonl").read_text().splitlines()
    responses = [json.loads(line) for line in lines]
    assert len(responses) == report["responses"] == 32
    assert sum(len(x["tokens"]) for x in responses) == report["response_tokens"]
    # The hash can be recomputed from outside: SHA-256 over sorted (prompt_id, sample, tokens).
    h = hashlib.sha256()
    for x in sorted(responses, key=lambda x: (x["prompt_id"], x["sample"])):
        h.update(json.dumps([x["prompt_id"], x["sample"], x["tokens"]]).encode() + b"\n")
    assert h.hexdigest() == report["responses_sha256"]
    # --wandb: the report as one offline W&B run under --out, with the trainer's grouped keys
    run_file = next((out_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    (row,) = wandb_history(run_file)
    assert row["elastic/rank_seconds/dummy"] == pytest.approx(report["rank_seconds"]["dummy"])
    assert row["elastic/tokens_per_occupied_rank_s"] == pytest.approx(report["tokens_per_occupied_rank_s"])
    run = wandb_records(run_file, "run")[0]
    assert run.project == "t" and run.display_name == "rollout" and "policy:vanilla" in run.tags


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
        "experts_not_divisible": (["--ranks", 3], ["model.num_moe_experts (8)", "divisible by ranks (3)"]),
        "more_ranks_than_experts": (["--ranks", 16],
                                    ["ranks (16) exceeds the model's experts (8) in model.num_moe_experts"]),
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
                                  ["t3.jsonl:1:", "'response_len' must be >= 0", "-5"]),
    }


CASES = ["unknown_key", "wrong_type", "experts_not_divisible", "more_ranks_than_experts",
         "checkpoint_empty_dir", "checkpoint_is_a_file", "checkpoint_torn_safetensors",
         "checkpoint_missing_tensor", "checkpoint_other_model", "trace_bad_json", "trace_missing_field",
         "trace_negative_length"]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    return _bad_inputs(tmp_path_factory.mktemp("bad"))


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_before_any_rank_starts(bad_inputs, case):
    args, fragments = bad_inputs[case]
    r = cli("rollout", "--ranks", 2, *args, timeout=120)  # a later --ranks in `args` wins
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexfloor rollout: error: "), r.stderr[-2000:]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert "[rollout]" not in r.stderr and r.stdout == ""  # failed before spawning ranks


def test_bad_cases_cover_every_fixture(bad_inputs):
    assert sorted(bad_inputs) == sorted(CASES)


def test_torchrun_joins_the_process_group_and_matches_spawned_ranks(tailed_trace, tmp_path):
    common = ["rollout", "--trace", tailed_trace, "--length-scale", 0.01, "--quiet", "--sample"]
    spawned = cli(*common, "--ranks", 2, "--json", tmp_path / "spawned.json")
    assert spawned.returncode == 0, spawned.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # This interpreter's torchrun: a `torchrun` on PATH may belong to another environment, or be absent.
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "megatron_rl.cli",
                        *map(str, common), "--json", tmp_path / "torchrun.json"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("responses_sha256") == 1  # only rank 0 reports
    a = json.loads((tmp_path / "spawned.json").read_text())
    b = json.loads((tmp_path / "torchrun.json").read_text())
    assert b["ranks"] == 2 and a["responses_sha256"] == b["responses_sha256"]


def test_planned_floor1_detaches_a_rank_at_length_scale_1(tmp_path):
    """The tiny long-tailed trace decoded at its own lengths: plans priced on the CPU engine shrink
    (under the H100 cost model they kept every rank)."""
    trace = tmp_path / "tiny.jsonl"
    made = subprocess.run([sys.executable, "tools/make_trace.py", "--preset", "deepscaler", "--prompts", "16",
                           "--samples", "4", "--epochs", "3", "--median", "12", "--cap", "96", "--out", trace],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert made.returncode == 0, made.stderr
    out_json = tmp_path / "report.json"
    r = cli("rollout", "--trace", trace, "--length-scale", 1, "--policy", "planned", "--floor", 1,
            "--quiet", "--json", out_json)
    assert r.returncode == 0, r.stderr
    report = json.loads(out_json.read_text())
    assert report["final_stage"] > 0 and len(report["stages"]) > 1
    assert report["rank_seconds"]["idle"] + report["rank_seconds"]["leased"] > 0
