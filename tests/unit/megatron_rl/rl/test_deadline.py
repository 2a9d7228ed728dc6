"""The deadline stop (megatron_rl/rl/deadline.py) and the cluster's device refusal, without ranks.

tests/e2e/test_slurm.py runs the stop for real: a job whose time limit falls mid-run saves,
requeues and resumes.
"""
from __future__ import annotations

import pytest

from megatron_rl.errors import FlexFloorError
from megatron_rl.parallel.signals import StopOnSignal
from megatron_rl.rl import deadline as dl


def test_a_step_starts_only_if_it_and_its_save_fit_with_the_margin():
    now = [1000.0]
    d = dl.Deadline(end=1100.0, source="test", clock=lambda: now[0])
    assert not d.must_stop()  # nothing measured: the first step runs
    d.after_step(20.0)  # no save measured yet: a save counts as long as a step
    assert d.needed_s() == pytest.approx(dl.MARGIN_FACTOR * 40 + dl.MARGIN_S)
    assert not d.must_stop()  # 100 s left, 80 s needed
    d.after_save(40.0)
    assert d.needed_s() == pytest.approx(dl.MARGIN_FACTOR * 60 + dl.MARGIN_S) and d.must_stop()
    d.after_step(5.0)  # the slowest step counts, not the last
    assert d.step_s == 20.0 and "100 s left before test" in d.reason()


def test_the_end_comes_from_end_by_or_the_slurm_job_less_the_signal_lead(monkeypatch):
    assert dl.job_end(None, env={}) is None
    assert dl.job_end("2026-12-01T23:00:00Z", env={})[0] == 1796166000.0
    end, source = dl.job_end(None, env={"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": "5000", "FF_SIGNAL_LEAD_S": "600"})
    assert end == 4400.0 and "Slurm job 7" in source and "600 s" in source
    monkeypatch.setattr(dl, "_squeue_end", lambda job: 9000.0)  # an older Slurm: squeue says
    assert dl.job_end(None, env={"SLURM_JOB_ID": "7"})[0] == 9000.0
    with pytest.raises(FlexFloorError, match=r"^end_by: expected an ISO 8601 time .* got 'tomorrow'"):
        dl.parse_time("tomorrow", "end_by")


def test_a_deadline_on_any_rank_stops_every_rank_and_requeues_under_slurm(tmp_path, monkeypatch):
    with StopOnSignal() as stop:
        assert not stop.requested(False)
        assert stop.requested(True) and stop.deadline and stop.signum is None
    d = dl.Deadline(end=0.0, source="the job's end", clock=lambda: 10.0)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    summary = dl.stopped_summary(3, stop, d, tmp_path, rank=0)
    assert summary["step"] == 3 and "before the job's end" in summary["deadline"]
    assert (tmp_path / dl.REQUEUE_FILE).read_text().startswith("step 3: ")


def test_no_gpu_in_a_slurm_job_is_refused_unless_cpu_is_asked_for(monkeypatch):
    from megatron_rl.parallel.device import resolve_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert resolve_device("auto") == "cpu"  # on a workstation auto still means CPU
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    for choice in ("auto", "cuda"):
        with pytest.raises(FlexFloorError, match=r"Slurm job 7 shows no GPU: submit with --gpus-per-node=N"):
            resolve_device(choice)
    assert resolve_device("cpu") == "cpu"


def test_end_by_is_checked_with_the_config(tmp_path):
    from megatron_rl.trainer_config import TrainerConfig

    assert TrainerConfig(end_by="2026-12-01T23:00:00+00:00").end_by
    with pytest.raises(FlexFloorError, match="end_by"):
        TrainerConfig(end_by="soon")
