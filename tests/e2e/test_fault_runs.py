"""Faults met once the ranks run: a corrupted training checkpoint, a
run that turns NaN, an HF checkpoint of NaN weights; each is one line, exit 2, and no rank remains."""
import json

import pytest

from megatron_rl.cli import main
from tests.process_tree import one_line_exit_2 as _one_line_exit_2
from tests.tiny_train import tiny_train_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]





@pytest.fixture
def train_cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    return tiny_train_config(tmp_path, steps=2, checkpoint={"every": 1, "export_hf": False})


def test_a_corrupted_shard_stops_the_resume_naming_the_file(train_cfg, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--config", str(train_cfg), "--out", str(out)]) == 0
    ckpt = out / "checkpoints" / "step_000002"
    shard = sorted(ckpt.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    _one_line_exit_2(capsys, ["train", "--config", str(train_cfg), "--out", str(out), "--steps", "3"],
                     f"{shard}: checksum mismatch")
    assert (out / "checkpoints" / "latest").read_text() == "step_000002"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_run_that_turns_non_finite_stops_naming_the_step_and_keeps_the_last_good_checkpoint(
        train_cfg, tmp_path, capsys):
    out = tmp_path / "out"
    line = _one_line_exit_2(capsys, ["train", "--config", str(train_cfg), "--out", str(out), "optim.lr=1e30",
                                     "optim.grad_clip=0", "steps=6"], "non-finite")
    step = int(line.split("step ")[1].split(":")[0])
    last = out / "checkpoints" / f"step_{step - 1:06d}"
    assert f"last good checkpoint: {last if step > 1 else 'none'}" in line, line
    if step > 1:
        assert (out / "checkpoints" / "latest").read_text() == last.name
    assert not (out / "checkpoints" / f"step_{step:06d}").exists()


def test_an_hf_checkpoint_of_nan_weights_is_refused(tmp_path, capsys):
    import torch

    from megatron_rl.models import MoEModelConfig, Qwen3MoeModel, save_hf_checkpoint

    model = Qwen3MoeModel(MoEModelConfig(), dtype=torch.float32)
    model.init_weights(0)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "linear_qkv" in n).fill_(float("nan"))
    save_hf_checkpoint(model, tmp_path / "nan_ckpt")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"checkpoint: {tmp_path / 'nan_ckpt'}\n")
    _one_line_exit_2(capsys, ["rollout", "--config", str(cfg), "--ranks", "2", "--quiet"],
                     f"{tmp_path / 'nan_ckpt'}: weight", "non-finite value(s) (NaN or inf)")


def test_a_reused_rollout_out_drops_the_files_of_an_earlier_run(tmp_path):
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout_runner import prepare

    out = tmp_path / "run"
    out.mkdir()
    for stale in ("ledger.rank3.json", "responses.rank3.jsonl", "report.json", "responses.jsonl"):
        (out / stale).write_text("{}")
    (out / "notes.txt").write_text("mine")
    prepare(RolloutConfig(ranks=2), str(out))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "plan.json"]
