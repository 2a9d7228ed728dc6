"""Stop before the job's time runs out, with the last step saved: Megatron-LM's --exit-duration-in-mins.

A Slurm job that reaches its time limit ends as TIMEOUT, which Slurm does not requeue, and a stop
signal shortly before it leaves the ranks the signal's lead to finish a step and save (and on torch
before 2.10 torchrun kills them 30 s after its SIGTERM, whatever TORCH_ELASTIC_SHUTDOWN_TIMEOUT
says). So the trainer plans instead: after each step it starts the next one only if that step and
its save still fit before the end, judged by the longest step and save measured so far:

    stop when  now + MARGIN_FACTOR x (step_s + save_s) + MARGIN_S  >  end

Before the first save is measured a save is taken to last as long as a step. The end is
`end_by` (config) / `--deadline` (an ISO 8601 time, or Unix seconds), else the job's end
(SLURM_JOB_END_TIME, or `squeue`) less FF_SIGNAL_LEAD_S, the lead of the sbatch's `--signal`, so the
trainer has saved before the signal path is needed at all. A stop for the deadline saves, exits 0
and, under Slurm, leaves OUT/REQUEUE_FILE for examples/slurm/launch.sh to requeue the job.
"""
from __future__ import annotations

import os
import subprocess
import time
from datetime import datetime
from pathlib import Path

from megatron_rl.config import parse_time

MARGIN_FACTOR = 1.25  # a step or save 25% slower than the slowest seen so far still fits
MARGIN_S = 30.0  # plus this, for the exit and the requeue
REQUEUE_FILE = "requeue"  # written by rank 0 when it stopped for the deadline under Slurm


def _squeue_end(job_id: str) -> float | None:
    try:
        res = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True,
                             timeout=10)
        return datetime.fromisoformat(res.stdout.strip()).timestamp() if res.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):  # no squeue here, or UNLIMITED/N/A
        return None


def job_end(end_by: str | None, env=os.environ) -> tuple[float, str] | None:
    """(the time by which the last step must be saved, where it came from), or None: no end known."""
    if end_by:
        return parse_time(end_by, "end_by"), f"end_by {end_by}"
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    end = env.get("SLURM_JOB_END_TIME", "")
    end_s = float(end) if end.isdigit() else _squeue_end(job)
    if end_s is None:
        return None
    lead = float(env.get("FF_SIGNAL_LEAD_S") or 0)
    return end_s - lead, f"Slurm job {job}'s end less FF_SIGNAL_LEAD_S {lead:g} s"


class Deadline:
    """`after_step(step_s)` and `after_save(save_s)` record durations; `must_stop()` says whether
    the next step and its save no longer fit. Every rank must reach the same answer: the trainer
    all-reduces it with the stop signals (parallel/signals.py)."""

    def __init__(self, end: float, source: str, clock=time.time):
        self.end, self.source, self.clock = end, source, clock
        self.step_s = self.save_s = 0.0
        self.saved = False

    def after_step(self, seconds: float) -> None:
        self.step_s = max(self.step_s, seconds)

    def after_save(self, seconds: float) -> None:
        self.save_s = max(self.save_s, seconds)
        self.saved = True

    def needed_s(self) -> float:
        save = self.save_s if self.saved else self.step_s
        return MARGIN_FACTOR * (self.step_s + save) + MARGIN_S

    def must_stop(self) -> bool:
        return self.clock() + self.needed_s() > self.end

    def reason(self) -> str:
        left = self.end - self.clock()
        return (f"{left:.0f} s left before {self.source}, the next step and its save need {self.needed_s():.0f} s "
                f"(slowest step {self.step_s:.1f} s, save {self.save_s:.1f} s, x{MARGIN_FACTOR:g} + {MARGIN_S:g} s)")


def mark_requeue(out_dir: Path, reason: str, env=os.environ) -> None:
    """Under Slurm, ask the batch script (examples/slurm/launch.sh) to requeue the job."""
    if env.get("SLURM_JOB_ID"):
        (Path(out_dir) / REQUEUE_FILE).write_text(reason + "\n")


def run_deadline(end_by: str | None, rank: int) -> Deadline | None:
    """The run's Deadline (None: no end known), said in one line by rank 0."""
    import sys

    found = job_end(end_by)
    if rank == 0 and found is not None:
        at = datetime.fromtimestamp(found[0]).astimezone().isoformat(timespec="seconds")
        print(f"[train] deadline {at} ({found[1]}): a step starts only if it and its save fit before then",
              file=sys.stderr, flush=True)
    if rank == 0 and old_torchrun():
        import torch

        print(f"[train] torch {torch.__version__}'s torchrun ends the ranks 30 s after a SIGTERM (it ignores "
              "TORCH_ELASTIC_SHUTDOWN_TIMEOUT): " + ("the deadline stop saves before the time limit instead; "
              "a pre-emption saves only if a step and its save fit in 30 s" if found else "no job end is known "
              "(set end_by or --deadline), so a stop signal saves only if a step and its save fit in 30 s"),
              file=sys.stderr, flush=True)
    return None if found is None else Deadline(*found)


def old_torchrun(env=os.environ) -> bool:
    """Under torchrun from torch before 2.10, whose agent ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "TORCHELASTIC_RUN_ID" in env and (major, minor) < (2, 10)


def stopped_summary(step: int, stop, deadline: Deadline | None, out_dir: Path, rank: int) -> dict:
    """The run summary's `stopped` entry; a deadline stop also asks Slurm for a requeue (rank 0)."""
    import signal

    if stop.signum is not None:
        return {"step": step, "signal": signal.Signals(stop.signum).name}
    reason = deadline.reason() if deadline is not None else "another rank's deadline"
    if rank == 0:
        mark_requeue(out_dir, f"step {step}: {reason}")
    return {"step": step, "deadline": reason}
