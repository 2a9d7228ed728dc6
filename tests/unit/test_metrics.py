import json

import pytest
from conftest import wandb_history

from megatron_rl.metrics import LoggingConfig, MetricsLogger, flatten, length_stats


def test_length_stats():
    s = length_stats([1, 2, 3, 10], [False, False, False, True])
    assert s["response_len_mean"] == 4.0 and s["response_len_max"] == 10.0
    assert s["response_len_p50"] == 2.5 and s["truncated_share"] == 0.25
    assert s["response_len_p99"] == pytest.approx(10 - 0.03 * 7)


def test_flatten_keeps_numbers_only():
    assert flatten({"a": {"b": 1, "c": "x"}, "d": 2.5, "e": True}) == {"a/b": 1.0, "d": 2.5, "e": 1.0}


def test_jsonl_and_offline_wandb_both_hold_the_metrics(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log = MetricsLogger(tmp_path, LoggingConfig(project="t"), run_config={"seed": 1})
    ledger = {"busy": 3.0, "dummy": 1.0, "transition": 0.0, "leased": 0.0, "idle": 0.0}
    for step in (1, 2):
        log.log(step, {"reward_mean": 0.1 * step, "response_len_mean": 4.0, "rank_seconds": ledger,
                       "loss": -0.5, "grad_norm": 1.5, "kl": 0.0, "phase_s": {"rollout": 2.0}})
    run_dir = log.wandb_dir
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[1]["rank_seconds"]["dummy"] == 1.0
    assert run_dir.name.startswith("offline-run-")
    history = wandb_history(next(run_dir.glob("run-*.wandb")))
    assert [h["_step"] for h in history] == [1, 2]
    assert history[1]["reward_mean"] == pytest.approx(0.2)
    assert history[0]["rank_seconds/dummy"] == 1.0 and history[0]["phase_s/rollout"] == 2.0


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    log = MetricsLogger(tmp_path, LoggingConfig(wandb_mode="disabled"))
    for step in (1, 2, 3):
        log.log(step, {"reward_mean": float(step)})
    log.close()
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 4, "rew')  # cut by a crash
    log = MetricsLogger(tmp_path, LoggingConfig(wandb_mode="disabled"), resume_step=2)
    log.log(3, {"reward_mean": 30.0})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["reward_mean"]) for x in lines] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_wandb_mode_from_environment_is_checked(tmp_path, monkeypatch):
    from megatron_rl.errors import FlexFloorError

    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(FlexFloorError, match="WANDB_MODE"):
        MetricsLogger(tmp_path, LoggingConfig())
