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
from slurm_cluster import LocalSlurm, SlurmUnavailable

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


def test_train_sbatch_requeues_on_usr1_and_the_real_trainer_resumes_from_its_checkpoint(slurm, tmp_path):
    from tests.tiny_train import tiny_train_config

    # Enough steps that the run is still training when the signal comes (a tiny step takes ~0.1 s).
    steps = 300
    cfg = tiny_train_config(tmp_path, steps=steps)
    env = dict(_python_env(tmp_path), NPROC_PER_NODE="2", WANDB_MODE="disabled")
    run, out = tmp_path / "run", tmp_path / "job.out"
    rc, job = slurm.sbatch(SLURM_DIR / "train.sbatch", str(cfg), "--seed", "3", wait=False,
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
    stopped = [int(n) for n in re.findall(r"^stopped by SIGTERM after step (\d+)", log, re.M)]
    assert len(stopped) == 1 and 0 < stopped[0] < steps, log
    assert f"resuming from {run / 'checkpoints' / f'step_{stopped[0]:06d}'} (step {stopped[0]})" in log, log
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), log
    assert (run / "checkpoints" / "latest").read_text() == f"step_{steps:06d}"
