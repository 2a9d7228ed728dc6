"""Per-step metrics: a plain JSONL file (always) and Weights & Biases (offline unless asked).

`DIR/metrics.jsonl` holds one JSON object per step, nested as the trainer produced it (the ledger's
`rank_seconds` stays a dict of the five states). W&B gets the same numbers flattened to
`a/b/c` keys. W&B runs offline by default, writing under `DIR/wandb/`; the user turns it online
with `WANDB_MODE=online` in the environment (which wins) or `logging.wandb_mode: online`, and off
with `disabled`. Only rank 0 logs.

On resume, lines for steps after the checkpoint are dropped from the JSONL file first: those steps
are about to be recomputed, and the file must read as one uninterrupted run.
"""
from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from megatron_rl.config import require

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggingConfig:
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "flexfloor"
    run_name: str | None = None

    def __post_init__(self) -> None:
        require(bool(self.project), "logging.project: expected a W&B project name")


def length_stats(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """Response-length figures of one rollout (p50/p99 by linear interpolation)."""
    a = np.asarray(lengths, dtype=np.float64)
    if a.size == 0:
        return {}
    return {
        "response_len_mean": float(a.mean()),
        "response_len_p50": float(np.percentile(a, 50)),
        "response_len_p99": float(np.percentile(a, 99)),
        "response_len_max": float(a.max()),
        "truncated_share": float(np.mean(np.asarray(truncated, dtype=bool))),
    }


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """{'a': {'b': 1}} -> {'a/b': 1}; non-numeric leaves are left out (W&B charts numbers)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, (bool, int, float, np.integer, np.floating)):
            out[name] = float(value)
    return out


def _drop_steps_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", -1) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash mid-write: the step is recomputed anyway
    path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")


class MetricsLogger:
    def __init__(
        self,
        out_dir: str | Path,
        cfg: LoggingConfig,
        run_config: dict[str, Any] | None = None,
        resume_step: int | None = None,
    ):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        else:
            _drop_steps_after(self.path, resume_step)
        self._fh = self.path.open("a", encoding="utf-8")
        self.mode = os.environ.get("WANDB_MODE") or cfg.wandb_mode
        require(self.mode in WANDB_MODES,
                f"WANDB_MODE / logging.wandb_mode: expected one of {WANDB_MODES}, got {self.mode!r}")
        self._run = None
        if self.mode != "disabled":
            self._run = self._start_wandb(cfg, run_config or {}, resume_step is not None)

    def _start_wandb(self, cfg: LoggingConfig, run_config: dict, resuming: bool):
        import wandb

        # The run id lives beside the metrics so a resumed run continues the same W&B run.
        id_file = self.out_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resuming and id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        return wandb.init(
            project=cfg.project,
            name=cfg.run_name,
            id=run_id,
            resume="allow",
            mode=self.mode,
            dir=str(self.out_dir),
            config=run_config,
            settings=wandb.Settings(silent=True, console="off"),
        )

    @property
    def wandb_dir(self) -> Path | None:
        return Path(self._run.dir).parent if self._run is not None else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **metrics}
        self._fh.write(json.dumps(record, default=float) + "\n")
        self._fh.flush()
        if self._run is not None:
            self._run.log(flatten(metrics), step=step)

    def close(self) -> None:
        self._fh.close()
        if self._run is not None:
            import wandb

            self._run.finish()
            # finish() returns before the W&B service has written the run file; teardown waits
            # for it, so the offline run is complete on disk when close() returns.
            wandb.teardown()
            self._run = None
