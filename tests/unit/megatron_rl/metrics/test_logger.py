import json

import pytest
from conftest import wandb_history, wandb_records

from megatron_rl.metrics.logger import LoggingConfig, MetricsLogger, gpu_memory, length_stats
from megatron_rl.metrics.wandb_run import run_name
from tests.helpers import REPO


def test_length_stats():
    s = length_stats([1, 2, 3, 10], [False, False, False, True])
    assert s["response_len_mean"] == 4.0 and s["response_len_max"] == 10.0
    assert s["response_len_p50"] == 2.5 and s["truncated_share"] == 0.25
    assert s["response_len_p99"] == pytest.approx(10 - 0.03 * 7)


def test_jsonl_and_offline_wandb_both_hold_the_grouped_metrics(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log = MetricsLogger(tmp_path, LoggingConfig(project="t", experiment="exp"), run_config={"seed": 1},
                        tags=["policy:planned", "floor:4"])
    ledger = {"busy": 3.0, "dummy": 1.0, "transition": 0.0, "leased": 0.0, "idle": 0.0}
    for step in (1, 2):
        log.log(step, {"reward_mean": 0.1 * step, "response_len_mean": 4.0, "rank_seconds": ledger,
                       "loss": -0.5, "grad_norm": 1.5, "kl": 0.0, "phase_s": {"rollout": 2.0},
                       "stages": [[0, 1, 2, 3], [0, 1]], "layout": "natural"})
    run_dir = log.wandb_dir
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[1]["elastic/rank_seconds/dummy"] == 1.0
    assert lines[0]["elastic/stages"] == [[0, 1, 2, 3], [0, 1]] and lines[0]["elastic/layout"] == "natural"
    assert run_dir.name.startswith("offline-run-")
    run_file = next(run_dir.glob("run-*.wandb"))
    history = wandb_history(run_file)
    assert [(h["_step"], h["trainer/step"]) for h in history] == [(1, 1), (2, 2)]
    assert history[1]["reward/mean"] == pytest.approx(0.2)
    assert history[0]["elastic/rank_seconds/dummy"] == 1.0 and history[0]["timing_s/gen"] == 2.0
    assert history[0]["elastic/num_stages"] == 2 and history[0]["elastic/floor_ranks"] == 2
    assert "elastic/layout" not in history[0]  # W&B charts numbers; the JSONL keeps the rest
    for h, line in zip(history, lines):
        assert {k: v for k, v in h.items() if not k.startswith("_")} == {
            k: v for k, v in line.items() if isinstance(v, (int, float)) and k != "step"} | {
            "trainer/step": line["step"]}
    # every chart's x-axis is the trainer step, so a resumed run's later W&B steps plot in place
    metrics = {m.name or m.glob_name: m.step_metric for m in wandb_records(run_file, "metric")}
    assert metrics.get("*") == "trainer/step"
    run = wandb_records(run_file, "run")[0]
    assert run.display_name == "exp" and run.run_group == "exp" and list(run.tags) == ["policy:planned", "floor:4"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["seed"] == 1  # the resolved config the trainer passes


def test_wandb_steps_only_increase_across_resumes(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = LoggingConfig(project="t")
    for resume, steps in ((None, range(1, 4)), (1, range(2, 4)), (2, range(3, 5))):
        log = MetricsLogger(tmp_path, cfg, resume_step=resume)
        for step in steps:
            log.log(step, {"reward_mean": float(step)})
        log.close()
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = [(h["_step"], h["trainer/step"]) for f in files for h in wandb_history(f)]
    assert len({f.name for f in files}) == 1  # the same run id each time
    assert rows == [(1, 1), (2, 2), (3, 3), (4, 2), (5, 3), (6, 3), (7, 4)]


def test_run_name_carries_the_slurm_job(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert run_name(LoggingConfig(experiment="qwen3")) == "qwen3"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NAME", "flexfloor-train")
    assert run_name(LoggingConfig(experiment="qwen3")) == "qwen3-flexfloor-train-4242"
    assert run_name(LoggingConfig(experiment="qwen3", run_name="ablate")) == "ablate-flexfloor-train-4242"


def test_gpu_memory_is_empty_without_cuda():
    import torch

    if torch.cuda.is_available():
        assert set(gpu_memory()) == {"max_memory_allocated_gb", "max_memory_reserved_gb"}
    else:
        assert gpu_memory() == {}


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
    assert [(x["step"], x["reward/mean"]) for x in lines] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_wandb_mode_from_environment_is_checked(tmp_path, monkeypatch):
    from megatron_rl.errors import FlexFloorError

    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(FlexFloorError, match="WANDB_MODE"):
        MetricsLogger(tmp_path, LoggingConfig())


def test_examples_log_offline():
    """Online is an explicit opt-in (WANDB_MODE=online): no example waits on W&B from a compute node."""

    from megatron_rl.config import load_dataclass
    from megatron_rl.trainer_config import TrainerConfig

    examples = sorted((REPO / "examples").glob("*grpo*.yaml"))
    examples += sorted((REPO / "examples").glob("qwen3*.yaml"))
    examples += sorted((REPO / "examples").glob("*reasoning_gym*.yaml"))
    assert len(examples) >= 3
    for path in examples:
        assert load_dataclass(TrainerConfig, path).logging.wandb_mode == "offline", path.name
