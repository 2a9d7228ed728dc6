"""The megatron backend through the product on the megatron-core CPU harness (tests/megatron_harness.py):
`flexfloor rollout` with backend megatron on 2 and 4 gloo ranks, vanilla and natural floor 1 (shrink
to rank 0, restore, weight checksums checked by the runtime), responses equal to the torch
backend's in float32; `flexfloor train` backend megatron on 2 ranks: GRPO steps with checkpoints, a
bit-identical resume, the HF export; and, without the harness, the one-line refusal a user gets on
a CPU machine.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train_cli import CONFIG as TRAIN_CLI_CONFIG

from tests.helpers.cli import cli, one_line_error
from tests.helpers.train import learning, metrics, train

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(420)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
ROLLOUT = dict(dtype="float32", batch=dict(prompts=4, samples=2, epochs=3, length_scale=0.003))
FLAGS = ["dtype=float32", "batch.prompts=4", "batch.samples=2", "batch.epochs=3", "batch.length_scale=0.003"]


def _cfg(**fields):
    from megatron_rl.rollout.config import BatchConfig, RolloutConfig

    return RolloutConfig(batch=BatchConfig(**ROLLOUT["batch"]), dtype=ROLLOUT["dtype"], **fields)


@pytest.mark.slow
def test_megatron_rollouts_on_two_and_four_ranks_equal_the_torch_backend(megatron_harness, tmp_path):
    from megatron_rl.rollout_runner import run_rollouts

    # 2 ranks, one world (what `flexfloor rollout` runs, three times): torch, megatron vanilla,
    # megatron natural floor 1.
    cfgs = [_cfg(ranks=2, policy="vanilla", backend="torch"),
            _cfg(ranks=2, policy="vanilla", backend="megatron"),
            _cfg(ranks=2, policy="natural", floor=1, backend="megatron")]
    torch_rep, vanilla, natural = (r.report for r in run_rollouts(cfgs, quiet=True))
    assert vanilla["moe"] == natural["moe"] == {"backend": "megatron", "experts": "GroupedMM",
                                                "transformer_engine": None}
    assert natural["stages"] == [[0, 1], [0]] and natural["final_stage"] == 1  # shrank, then restored
    assert torch_rep["responses_sha256"] == vanilla["responses_sha256"] == natural["responses_sha256"]

    # 4 ranks through the CLI as a user runs it. The torch backend's responses here are the same on
    # any rank count (float32, greedy: checked on 1, 2 and 4 ranks), so its 2-rank hash is
    # the reference.
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "rollout", "--ranks", "4", "--policy", "natural",
                        "--floor", "1", "--device", "cpu", "--quiet", "--json", str(out), "backend=megatron", *FLAGS],
                       cwd=REPO, env=site_env(), capture_output=True, text=True, timeout=400, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["moe"]["experts"] == "GroupedMM" and len(report["stages"]) > 1 and report["final_stage"] >= 1
    assert report["responses_sha256"] == torch_rep["responses_sha256"]


@no_cuda
def test_without_the_harness_backend_megatron_is_refused_on_cpu_in_one_line(tmp_path):
    cfg = tmp_path / "gpu.yaml"
    cfg.write_text("backend: megatron\n")
    one_line_error(cli("rollout", "--config", cfg, "--ranks", "2", "--device", "cpu"),
                   "no CUDA device; use `backend: torch`")
    text = (REPO / "examples" / "tiny_cpu_grpo.yaml").read_text().replace("dtype: float64", "dtype: bfloat16")
    cfg.write_text(text + "\nbackend: megatron\n")
    one_line_error(train(cfg, tmp_path / "run", expect=2), "no CUDA device; use `backend: torch`")
    assert not (tmp_path / "run").exists()  # refused before any rank or folder


# test_train_cli's tiny GRPO run, in float32 (megatron-core runs bf16 or fp32) without the KL term
# (not supported with backend megatron), logging off.
TRAIN = {**TRAIN_CLI_CONFIG, "grpo": {**TRAIN_CLI_CONFIG["grpo"], "kl_coef": 0.0}, "dtype": "float32",
         "backend": "megatron", "logging": {"wandb_mode": "disabled"}}
TWO_CPU_RANKS = ("--ranks", "2", "--device", "cpu")


def site_env() -> dict:
    from megatron_harness import site_env as env

    return env()


@pytest.mark.slow
def test_flexfloor_train_backend_megatron_resumes_bit_identically_and_exports_as_the_torch_backend(
        megatron_harness, tmp_path):
    import shutil

    import torch
    import yaml
    from safetensors.torch import load_file

    from megatron_rl.data.arith import make_problems, write_jsonl
    from megatron_rl.models.hf import load_hf_checkpoint, save_hf_checkpoint

    write_jsonl(make_problems(20, seed=0, max_operand=4, ops="+"), tmp_path / "arith.jsonl")
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({**TRAIN, "data": {"path": str(tmp_path / "arith.jsonl")}}))
    full = tmp_path / "full"
    train(config, full, *TWO_CPU_RANKS, env=site_env())
    rows = metrics(full)
    norms = [r["actor/grad_norm"] for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3] and norms[-1] > 0, norms  # step 3 updates after the resume
    ckpt = full / "checkpoints" / "step_000002"
    assert sorted(p.name for p in ckpt.glob("megatron_optim.rank*.pt")) == ["megatron_optim.rank0.pt",
                                                                            "megatron_optim.rank1.pt"]
    sums = json.loads((ckpt / "checksums.json").read_text())
    assert {"megatron_optim.rank0.pt", "megatron_optim.rank1.pt"} <= set(sums)  # covered by the checksums

    # Resume from step 2 of a copy: step 3 and the final weights equal the uninterrupted run's.
    part = tmp_path / "part"
    shutil.copytree(full, part, ignore=shutil.ignore_patterns("step_000003", "hf", "wandb"))
    (part / "checkpoints" / "latest").write_text("step_000002")
    lines = (part / "metrics.jsonl").read_text().splitlines()
    (part / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    r = train(config, part, *TWO_CPU_RANKS, env=site_env())
    assert "resuming from" in r.stderr and "step_000002" in r.stderr
    assert learning(metrics(part)[-1]) == learning(rows[-1])
    a, b = load_file(str(full / "hf" / "model.safetensors")), load_file(str(part / "hf" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The megatron-backed export is the torch backend's: its weights re-exported by a torch-backend
    # model give the same bytes.
    save_hf_checkpoint(load_hf_checkpoint(str(full / "hf"), torch.float32), tmp_path / "torch_hf")
    ours = (full / "hf" / "model.safetensors").read_bytes()
    assert (tmp_path / "torch_hf" / "model.safetensors").read_bytes() == ours
