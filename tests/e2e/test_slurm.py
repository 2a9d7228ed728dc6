"""The sbatch scripts of examples/slurm/ submitted to a real Slurm (munged + slurmctld + slurmd here).

The cluster is one node, this machine, brought up by `slurm_cluster.LocalSlurm`; the packages are
installed with apt when missing, and the tests skip (with the reason) only when that is impossible.
"""
from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import slurm_cluster
from conftest import running
from slurm_cluster import LocalSlurm, SlurmUnavailable, without_gpus

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "examples" / "slurm"

# apt-get on a clean machine plus the jobs themselves; the jobs alone take well under a minute.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def slurm():
    with running(LocalSlurm(), SlurmUnavailable, "no Slurm on this machine") as cluster:
        yield cluster


def test_slurm_that_cannot_be_installed_is_a_skip_with_the_reason(monkeypatch):
    monkeypatch.setattr(slurm_cluster, "_which", lambda binary: None)
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(SlurmUnavailable, match=r"sbatch, slurmctld, slurmd, munged not installed and not root"):
        slurm_cluster.ensure_installed()
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    with pytest.raises(SlurmUnavailable, match=r"no apt-get on this machine"):
        slurm_cluster.ensure_installed()


def _job_env(tmp_path: Path, flexfloor: str) -> dict[str, str]:
    # The checkout under test, not whatever `flexfloor` happens to be on PATH.
    return {"FLEXFLOOR": flexfloor, "FLEXFLOOR_HOME": str(REPO), "PYTHONPATH": str(REPO),
            "FF_RUN_DIR": str(tmp_path / "run")}


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"({path} was not written)"


def test_tiny_cpu_sbatch_runs_the_rollout_and_writes_its_report(slurm, tmp_path):
    out = tmp_path / "job.out"
    env = _python_env(tmp_path)
    rc, job = slurm.sbatch(SLURM_DIR / "tiny_cpu.sbatch", options=(f"--output={out}",), cwd=REPO,
                           env=env, timeout_s=300)
    log = _read(out)
    assert rc == 0, f"job {job} failed (sbatch --wait exit {rc}):\n{log}\n{slurm.logs()}"
    assert slurm.job_field(job, "JobState") in ("COMPLETED", ""), slurm.logs()
    assert "--nnodes=1 --nproc-per-node=4" in log, log  # the ranks came from torchrun, not a spawn
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["ranks"] == 4 and report["responses"] == 64, report
    # The ledger invariant: every rank-second is in exactly one state (Ledger.check's 10 ms per rank).
    assert sum(report["rank_seconds"].values()) == pytest.approx(4 * report["rollout_time_s"], abs=0.04)


def _python_env(tmp_path: Path) -> dict[str, str]:
    # This interpreter for flexfloor and torchrun, so the job runs without an activated environment.
    py = shlex.quote(sys.executable)
    return dict(_job_env(tmp_path, f"{py} -m megatron_rl.cli"), FF_TORCHRUN=f"{py} -m torch.distributed.run")


def _cpu_train_sbatch(tmp_path: Path, signal: bool = True) -> Path:
    """train.sbatch less its `--gpus-per-node` line (this cluster has no GPUs; FF_DEVICE=cpu runs it),
    and, with `signal=False`, without its USR1 before the time limit, as a user could edit it."""
    script = without_gpus(SLURM_DIR / "train.sbatch", tmp_path)
    if not signal:
        script.write_text(script.read_text().replace("#SBATCH --signal=B:USR1@300\n", "")
                          .replace("FF_SIGNAL_LEAD_S=300", "FF_SIGNAL_LEAD_S=0"))
    return script


def _train_env(tmp_path: Path) -> dict[str, str]:
    return dict(_python_env(tmp_path), NPROC_PER_NODE="2", WANDB_MODE="disabled", FF_DEVICE="cpu")


def _steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def test_train_sbatch_requeues_on_usr1_and_the_real_trainer_resumes_from_its_checkpoint(slurm, tmp_path):
    from tests.tiny_train import tiny_train_config

    # Enough steps that the run is still training when the signal comes (a tiny step takes ~0.1 s).
    steps = 300
    cfg = tiny_train_config(tmp_path, steps=steps)
    env = _train_env(tmp_path)
    run, out = tmp_path / "run", tmp_path / "job.out"
    rc, job = slurm.sbatch(_cpu_train_sbatch(tmp_path), str(cfg), "--seed", "3", wait=False,
                           options=(f"--output={out}", "--time=30"), cwd=REPO, env=env)
    # 30 minutes: Slurm itself sends USR1 at time limit - 300 s, which must not come during the test.
    assert rc == 0 and job, slurm.logs()
    metrics = run / "metrics.jsonl"
    slurm.wait_until(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 240,
                     "the first training step")
    # What `#SBATCH --signal=B:USR1@300` delivers five minutes before the time limit.
    res = slurm.run(["scancel", "--signal=USR1", "--batch", job])
    assert res.returncode == 0, res.stderr
    slurm.wait_until(lambda: slurm.job_field(job, "JobState") in ("COMPLETED", "FAILED", ""), 400,
                     "the requeued job to finish")
    log = _read(out)
    assert slurm.job_field(job, "JobState") in ("COMPLETED", ""), log
    assert slurm.job_field(job, "Restarts") in ("1", ""), log
    assert "requeueing job" in log and "restart 1: flexfloor train resumes" in log, log
    # The first attempt saved the step it was in and exited 0; the second resumed from exactly there.
    stopped = [int(n) for n in re.findall(r"stopped by SIGTERM after step (\d+)", log)]
    assert len(stopped) == 1 and 0 < stopped[0] < steps, log
    assert f"resuming from {run / 'checkpoints' / f'step_{stopped[0]:06d}'} (step {stopped[0]})" in log, log
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), log
    assert (run / "checkpoints" / "latest").read_text() == f"step_{steps:06d}"


def test_a_job_whose_time_limit_falls_mid_run_saves_requeues_and_resumes_losing_nothing(slurm, tmp_path):
    from tests.tiny_train import tiny_train_config

    # A 2-minute limit and no signal before it (Slurm may send one up to a minute early, which
    # would race the deadline stop): the trainer must save and stop by itself before the limit
    # (rl/deadline.py), or Slurm ends the job as TIMEOUT, which it never requeues.
    cfg = tiny_train_config(tmp_path, steps=100000)
    run, out = tmp_path / "run", tmp_path / "job.out"
    rc, job = slurm.sbatch(_cpu_train_sbatch(tmp_path, signal=False), str(cfg), wait=False,
                           options=(f"--output={out}", "--time=2"), cwd=REPO, env=_train_env(tmp_path))
    assert rc == 0 and job, slurm.logs()
    resumed = re.compile(r"resuming from \S+step_(\d+) \(step (\d+)\)")
    # The second attempt resumed and trained one step past its checkpoint: then it is enough.
    slurm.wait_until(lambda: (m := resumed.search(_read(out))) and int(m.group(1)) + 1 in _steps(run / "metrics.jsonl"),
                     400, "the requeued job to resume")
    slurm.run(["scancel", job])
    log = _read(out)
    stopped = [int(n) for n in re.findall(r"stopped before the deadline \(.*\) after step (\d+)", log)]
    assert len(stopped) == 1 and "[train] deadline " in log and "got USR1" not in log, log
    assert re.search(r"stopped before the time limit \(step \d+: .*\), requeueing job", log), log
    assert int(resumed.search(log).group(1)) == stopped[0], log
    steps = _steps(run / "metrics.jsonl")
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > stopped[0], log  # nothing lost, nothing twice


def test_a_resubmitted_job_resumes_its_run_folder_from_the_job_name(slurm, tmp_path):
    from tests.tiny_train import tiny_train_config

    cfg = tiny_train_config(tmp_path, steps=1)
    env = {k: v for k, v in _train_env(tmp_path).items() if k != "FF_RUN_DIR"}
    script, jobs = _cpu_train_sbatch(tmp_path), []
    for n, steps in enumerate(("1", "2")):  # a second sbatch: a new job id, the same --job-name
        out = tmp_path / f"job{n}.out"
        rc, job = slurm.sbatch(script, str(cfg), "--steps", steps, cwd=tmp_path, env=env, timeout_s=300,
                               options=(f"--output={out}", "--job-name=ff-resubmit", "--time=10"))
        assert rc == 0, _read(out) + slurm.logs()
        jobs.append(job)
    run = tmp_path / "runs" / "ff-resubmit"
    assert jobs[0] != jobs[1] and "resuming from runs/ff-resubmit/checkpoints/step_000001 (step 1)" in _read(out)
    assert _steps(run / "metrics.jsonl") == [1, 2]
    assert len(list((run / "logs").glob("*/attempt_0/1/stderr.log"))) == 2  # rank 1's own log, per job


def test_a_job_without_gpus_stops_naming_gpus_per_node(slurm, tmp_path):
    out = tmp_path / "job.out"
    env = {k: v for k, v in _train_env(tmp_path).items() if k != "FF_DEVICE"}
    rc, job = slurm.sbatch(_cpu_train_sbatch(tmp_path), "cfg.yaml", cwd=REPO, env=env, timeout_s=120,
                           options=(f"--output={out}", "--time=10"))
    log = _read(out)
    assert rc != 0 and f"job {job} has no GPUs: submit with --gpus-per-node=N" in log and "torchrun" not in log, log
