"""`flexfloor train` on the driver: everything that can be checked before any rank starts (the
machine, the inputs, the checkpoint a rerun resumes from), then the ranks, each running the loop
of `trainer.py`. A mistake found here is one line and leaves no rank waiting on another.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_rl.config import write_config
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.errors import CheckpointError
from megatron_rl.metrics.logger import require_matplotlib
from megatron_rl.parallel.device import resolve_device
from megatron_rl.parallel.launch import run_ranks
from megatron_rl.parallel.torchrun import driver_process
from megatron_rl.preflight import preflight
from megatron_rl.rl.checkpoint.dcp import (
    checkpoint_at,
    latest_checkpoint,
    point_latest,
    read_trainer_state,
    vet_checkpoint,
)
from megatron_rl.rl.checkpoint.resume_fit import check_resume_fit
from megatron_rl.rl.checkpoint.retention import check_room
from megatron_rl.rl.input_checks import checked_inputs
from megatron_rl.rl.model_setup import check_init
from megatron_rl.trainer import build_trainer
from megatron_rl.trainer_config import TrainerConfig


def run_training(cfg: TrainerConfig, out_dir: str | Path, *, preflight_done: bool = False,
                 resume_step: int | None = None) -> dict | None:
    """Check the inputs here (the preflight unless the caller ran it, dataset, resume point), then
    train on `cfg.ranks` ranks.

    Resumes from `out_dir`'s latest checkpoint when there is one (`resume_step`: from that step's).
    Returns rank 0's summary (None on non-zero torchrun ranks).
    """
    if not preflight_done:
        preflight(cfg.backend, cfg.dtype, cfg.leases, cfg.optim.offload)
    if cfg.logging.plot_every:
        require_matplotlib("logging.plot_every")
    device = resolve_device(cfg.device)
    check_init(cfg)
    data, tok = checked_inputs(cfg)
    if resume_step is not None:
        resume = checkpoint_at(out_dir, resume_step)
    else:
        resume = latest_checkpoint(out_dir)
    if resume is not None:
        vet_checkpoint(resume, cfg.checkpoint.allow_unverified)  # before any of it is parsed
        state, _ = read_trainer_state(resume, cfg.model)
        check_resume_fit(cfg, data, tok, resume, state)
        if state["step"] >= cfg.steps:
            return _nothing_left(cfg, out_dir, resume, state["step"])
        print(f"[train] resuming from {resume} (step {state['step']})", file=sys.stderr)
        if resume_step is not None and driver_process():  # before metrics.jsonl loses the later steps
            point_latest(resume)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if driver_process():
        check_room(cfg, out_dir)  # a save that cannot fit is refused now, not half-way
        write_config(cfg, out_dir)
    return run_ranks(_rank_main, cfg.ranks, cfg, data, str(out_dir), resume, timeout_s=cfg.timeout_s,
                     stop_grace_s=cfg.checkpoint.stop_grace_s, device=device, writes_to=out_dir)


def _nothing_left(cfg: TrainerConfig, out_dir: str | Path, resume: Path, step: int) -> None:
    """The run's checkpoint `resume` is already at `cfg.steps`: a requeue that came after the last
    step was saved is done, not failed (None: nothing to train); any other run is refused."""
    done = f"{resume}: already at step {step} of steps={cfg.steps}"
    hf = Path(out_dir) / "hf"
    if cfg.checkpoint.export_hf and not hf.exists():  # an export that failed at the end
        done += f" (a missing {hf}: `flexfloor export --out {out_dir}` writes it)"
    if int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        print(f"[train] {done}; the requeued job has nothing left to train", file=sys.stderr)
        return None
    raise CheckpointError(f"{done}; raise `steps` to train further")


def _rank_main(ctx, cfg: TrainerConfig, data: PromptDataset, out_dir: str, resume: Path | None):
    return build_trainer(cfg, data, ctx, out_dir, resume).run()
