"""Per-step metrics: a plain JSONL file (always) and Weights & Biases (offline unless asked).

Both carry the same grouped names (`reward/mean`, `timing_s/gen`, `actor/lr`, ...; the table is
`megatron_rl/metrics/keys.py`, documented in docs/training.md). `DIR/metrics.jsonl` holds one JSON
object per step with every leaf, strings and lists included; W&B gets the numbers. Only rank 0 logs.
W&B modes, names, groups and tags: `megatron_rl/metrics/wandb_run.py`.

Resume. Lines for steps after the checkpoint are dropped from the JSONL file first: those steps
are about to be recomputed, and the file must read as one uninterrupted run. W&B keeps every row
it was sent and refuses a row whose W&B step is not above the run's last one, so recomputed steps
logged at their own step numbers would be dropped and the dashboard would keep the values of the
run that died. So the W&B step (`_step`) is a counter that only increases across every attempt of
the run (kept in `DIR/wandb_run.json` with the run id), and the trainer step is the logged metric
`trainer/step`, declared with `define_metric` as the x-axis of every chart.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rl.errors import FlexFloorError
from megatron_rl.files.owned_paths import write_file_atomically
from megatron_rl.metrics.keys import grouped, numeric
from megatron_rl.metrics.wandb_run import LoggingConfig, finish, resolve_mode, start_run

STEP_METRIC = "trainer/step"


def require_matplotlib(what: str) -> None:
    """Figures (timelines, simulator plots) need matplotlib, which is optional (the `plot` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise FlexFloorError(f"{what}: drawing figures needs matplotlib, which is not installed "
                             "(pip install matplotlib)") from None


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


def gpu_memory() -> dict[str, float]:
    """Peak GPU memory of this process since the last call (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    gb = 1024 ** 3
    out = {"max_memory_allocated_gb": torch.cuda.max_memory_allocated() / gb,
           "max_memory_reserved_gb": torch.cuda.max_memory_reserved() / gb}
    torch.cuda.reset_peak_memory_stats()
    return out


def _drop_steps_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line cut by a crash mid-write: the step is recomputed anyway
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
    # Rewritten beside itself and renamed: a crash now leaves the old file or the new one whole.
    write_file_atomically(path, "".join(f"{line}\n" for line in kept))


def read_run_state(path: Path) -> dict:
    """`wandb_run.json` ({"id": str, "last_step": int}); {} when absent; one line naming it when bad."""
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_bytes()[:4096].decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        state = e
    if not (isinstance(state, dict) and isinstance(state.get("id", ""), str)
            and isinstance(state.get("last_step", -1), int)):
        raise FlexFloorError(f"{path}: unreadable (expected {{\"id\": run id, \"last_step\": int}}); "
                             "remove it to log the resumed run as a new W&B run")
    return state


class MetricsLogger:
    def __init__(
        self,
        out_dir: str | Path,
        cfg: LoggingConfig,
        run_config: dict[str, Any] | None = None,
        resume_step: int | None = None,
        tags: Sequence[str] = (),
    ):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        else:
            _drop_steps_after(self.path, resume_step)
        self._fh = self.path.open("a", encoding="utf-8")
        self.mode = resolve_mode(cfg)
        self._run = None
        self._last_wandb_step = -1  # W&B refuses a row whose step is not above the last one sent
        self._state_file = self.out_dir / "wandb_run.json"
        if self.mode != "disabled":
            self._run, self._last_wandb_step = self._start_wandb(cfg, run_config or {}, resume_step is not None,
                                                                 list(tags))
            self._save_state()

    def _start_wandb(self, cfg: LoggingConfig, run_config: dict, resuming: bool, tags: list[str]):
        """The W&B run and the last W&B step it was sent. The run id lives beside the metrics, so a
        resumed run continues the same W&B run, and with it the last W&B step sent, so the next one
        is above it."""
        state = read_run_state(self._state_file) if resuming else {}
        run = start_run(self.out_dir, cfg, self.mode, config=run_config, tags=tags,
                        run_id=state.get("id") or os.urandom(4).hex())
        # Online, W&B knows the resumed run's next step; offline it starts at 0.
        last_step = max(state.get("last_step", -1), run.step - 1)
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC)
        return run, last_step

    def _save_state(self) -> None:
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": self._run.id, "last_step": self._last_wandb_step}), encoding="utf-8")
        tmp.replace(self._state_file)

    @property
    def wandb_dir(self) -> Path | None:
        return Path(self._run.dir).parent if self._run is not None else None

    def log(self, step: int, metrics: dict[str, Any], images: dict[str, Path] | None = None,
            tables: dict[str, tuple[list[str], list[list]]] | None = None) -> None:
        """One step's metrics; `images` (PNG files) and `tables` (columns, rows) go to W&B only, in
        the same row (the JSONL file names the images' files)."""
        flat = grouped(metrics)
        files = {f"plots/{k}": str(v) for k, v in (images or {}).items()}
        self._fh.write(json.dumps({"step": step, **flat, **files}, default=float) + "\n")
        self._fh.flush()
        if self._run is not None:
            import wandb

            media = {f"plots/{k}": wandb.Image(str(v)) for k, v in (images or {}).items()}
            media.update({k: wandb.Table(columns=c, data=r) for k, (c, r) in (tables or {}).items()})
            # A fresh run logs trainer step k at W&B step k; after a resume, above the last one sent.
            self._last_wandb_step = max(step, self._last_wandb_step + 1)
            self._run.log({**numeric(flat), **media, STEP_METRIC: step}, step=self._last_wandb_step)
            self._save_state()

    def close(self) -> None:
        self._fh.close()
        if self._run is not None:
            finish(self._run)
            self._run = None
