"""Weights & Biases runs for `train`, `rollout` and `simulate`: offline unless asked, found by name.

Offline is the default everywhere: compute nodes often have no internet, and an online init
there waits out W&B's 90-second timeout and fails. The files land in `DIR/wandb/offline-run-*`;
`wandb sync DIR/wandb/offline-run-*` uploads them from a login node. Online is an explicit
opt-in: `WANDB_MODE=online` in the environment (which wins) or `logging.wandb_mode: online`.

A run is named `<run_name or experiment>[-<SLURM_JOB_NAME>-<SLURM_JOB_ID>]`, grouped by the
experiment (the config file's name unless `logging.experiment` says otherwise) and tagged with the
policy and the floor, so the runs of one sweep sit together and a Slurm job's run is found by its id.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_rl.config import require

WANDB_MODES = ("offline", "online", "disabled")
# W&B's own rules (wandb/sdk/wandb_settings.py, 0.31: `validate_project`, `validate_run_tags`), checked
# at config load: wandb.init on rank 0 would raise them as a pydantic traceback after the ranks start.
WANDB_PROJECT_MAX, WANDB_PROJECT_CHARS, WANDB_TAG_MAX = 128, "/\\#?%:", 64


@dataclass
class LoggingConfig:
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "flexfloor"
    run_name: str | None = None
    experiment: str | None = None  # the W&B group; the CLI fills in the config file's name
    tags: list[str] = field(default_factory=list)
    # `flexfloor train`: every this many steps, the step's per-rank rollout timeline as a PNG
    # (OUT/timelines/) and to W&B with its segments as a table; 0: never (needs matplotlib).
    plot_every: int = 0

    def __post_init__(self) -> None:
        require(bool(self.project), "logging.project: expected a W&B project name")
        bad = "".join(c for c in WANDB_PROJECT_CHARS if c in self.project)
        require(len(self.project) <= WANDB_PROJECT_MAX and not bad,
                f"logging.project: a W&B project name has at most {WANDB_PROJECT_MAX} characters and none of "
                f"{' '.join(WANDB_PROJECT_CHARS)}; got {len(self.project)} characters"
                + (f" with {' '.join(bad)}" if bad else ""))
        for i, tag in enumerate(self.tags):
            require(1 <= len(str(tag)) <= WANDB_TAG_MAX,
                    f"logging.tags[{i}]: a W&B tag has 1 to {WANDB_TAG_MAX} characters, got {len(str(tag))}")
        require(self.plot_every >= 0, f"logging.plot_every: expected >= 0 steps (0: never), got {self.plot_every}")


def resolve_mode(cfg: LoggingConfig) -> str:
    mode = os.environ.get("WANDB_MODE") or cfg.wandb_mode
    require(mode in WANDB_MODES, f"WANDB_MODE / logging.wandb_mode: expected one of {WANDB_MODES}, got {mode!r}")
    return mode


def run_name(cfg: LoggingConfig) -> str:
    base = cfg.run_name or cfg.experiment or "flexfloor"
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return f"{base}-{os.environ.get('SLURM_JOB_NAME') or 'job'}-{job}"
    return base


def policy_tags(policy: str | None, floor: int | None) -> list[str]:
    return [f"policy:{policy}", f"floor:{floor if floor is not None else 'default'}"]


def start_run(out_dir: str | Path, cfg: LoggingConfig, mode: str, *, config: dict[str, Any],
              tags: list[str], run_id: str | None = None, job_type: str = "train"):
    """`wandb.init` into `out_dir/wandb/`; `run_id` given: continue that run (resume)."""
    import wandb

    return wandb.init(
        project=cfg.project,
        name=run_name(cfg),
        group=cfg.experiment,
        job_type=job_type,
        tags=[*tags, *cfg.tags],
        id=run_id,
        resume="allow" if run_id is not None else None,
        mode=mode,
        dir=str(out_dir),
        config=config,
        settings=wandb.Settings(silent=True, console="off"),
    )


def finish(run) -> None:
    import wandb

    run.finish()
    # finish() returns before the W&B service has written the run file; teardown waits for it,
    # so the offline run is complete on disk when this returns.
    wandb.teardown()


def log_report(out_dir: str | Path, cfg: LoggingConfig, *, job_type: str, config: dict[str, Any],
               tags: list[str], metrics: dict[str, float],
               tables: dict[str, tuple[list[str], list[list[Any]]]] | None = None,
               images: list[Path] | None = None) -> Path | None:
    """One W&B run holding a single report (a rollout's ledger, a simulation): numbers in the
    summary and one history row, `tables` as W&B tables, `images` (PNG files) as media.

    Returns the run's folder (None when W&B is disabled).
    """
    mode = resolve_mode(cfg)
    if mode == "disabled":
        return None
    import wandb

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    run = start_run(out_dir, cfg, mode, config=config, tags=tags, job_type=job_type)
    try:
        row: dict[str, Any] = dict(metrics)
        for name, (columns, rows) in (tables or {}).items():
            row[name] = wandb.Table(columns=columns, data=rows)
        for path in images or []:
            row[f"plots/{Path(path).stem}"] = wandb.Image(str(path))
        run.log(row)
        run.summary.update(metrics)
        folder = Path(run.dir).parent
    finally:
        finish(run)
    return folder
