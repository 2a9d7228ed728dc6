"""SIGTERM to `flexfloor train` saves and exits 0, and the same command resumes; SIGTERM to
`flexfloor rollout` ends every rank and keeps the finished responses."""
import json
import os
import signal

import pytest

from tests.process_tree import assert_group_gone, finish, flexfloor, lines, training_started, wait_for
from tests.tiny_train import tiny_train_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_sigterm_to_train_saves_exits_0_and_the_same_command_resumes(tmp_path):
    cfg = tiny_train_config(tmp_path, steps=500)
    out = tmp_path / "out"
    proc = training_started(cfg, out)
    # To every process of the run, as Slurm's pre-emption and a closed terminal signal: the
    # launcher's fork server must outlive it, or its ranks die with it, unsaved (parallel/rank_start.py).
    os.killpg(proc.pid, signal.SIGTERM)
    rc, stdout, err, _ = finish(proc, 120)
    assert rc == 0, err[-3000:]
    done = len(lines(out / "metrics.jsonl"))
    assert f"stopped by SIGTERM after step {done} (checkpoint saved)" in stdout, stdout
    assert (out / "checkpoints" / "latest").read_text() == f"step_{done:06d}"
    assert not (out / "hf").exists()  # the export waits for the real last step
    assert_group_gone(proc.pid)

    again = flexfloor("train", "--config", str(cfg), "--out", str(out), "--steps", str(done + 1),
                      env={"WANDB_MODE": "disabled"})
    rc, _, err, _ = finish(again, 120)
    assert rc == 0, err[-3000:]
    assert f"resuming from {out / 'checkpoints' / f'step_{done:06d}'} (step {done})" in err, err
    assert [json.loads(m)["step"] for m in lines(out / "metrics.jsonl")] == list(range(1, done + 2))
    assert_group_gone(again.pid)


def test_sigterm_to_rollout_ends_every_rank_and_keeps_finished_responses(tailed_trace, tmp_path):
    out = tmp_path / "run"
    # Full-length responses (up to 16384 tokens), so the model needs that many positions.
    proc = flexfloor("rollout", "--trace", str(tailed_trace), "--ranks", "2", "--length-scale", "1.0",
                     "--out", str(out), "--quiet", "model.max_position_embeddings=16500")
    streamed = [out / "responses.rank0.jsonl", out / "responses.rank1.jsonl"]
    wait_for(lambda: any(lines(p) for p in streamed), 180, "a finished response", proc)
    proc.send_signal(signal.SIGTERM)
    rc, _, err, waited = finish(proc, 60)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("flexfloor rollout: interrupted by SIGTERM"), err[-3000:]
    assert waited < 20, waited
    kept = [json.loads(line) for p in streamed for line in lines(p)]
    assert kept and all(len(r["tokens"]) > 0 for r in kept)
    assert not (out / "report.json").exists()
    assert_group_gone(proc.pid)
