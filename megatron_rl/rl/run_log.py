"""Rank 0's log of a training run: a row per step in metrics.jsonl and W&B (`metrics/logger.py`), with the
step's rollout timeline every `logging.plot_every` steps and the held-out generations after a
validation, and one line per step on stderr. Only rank 0 keeps one: every figure it logs is already
global (summed or gathered over the ranks in the step).
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

from elastic.timeline import Timeline
from elastic.timeline_plot import plot_timelines
from megatron_rl.metrics.logger import MetricsLogger
from megatron_rl.metrics.wandb_run import policy_tags
from megatron_rl.provenance import provenance
from megatron_rl.trainer_config import TrainerConfig


class RunLog:
    def __init__(self, cfg: TrainerConfig, out_dir: Path, resume_step: int | None, moe: dict):
        """`resume_step`: the step a resumed run continues after (None: a new run); `moe`: what hosts
        the MoE layers (the backend's `describe()`), for the run's W&B config."""
        self.cfg, self.out_dir = cfg, out_dir
        self.logger = MetricsLogger(out_dir, cfg.logging,
                                    run_config={**asdict(cfg), "moe": moe,
                                                "provenance": provenance()},
                                    resume_step=resume_step, tags=policy_tags(cfg.elastic.policy, cfg.elastic.floor))

    def validation(self, val: dict, tables: dict, t0: float) -> None:
        """The validation before any RL update (step 0): the warm start's figure."""
        self.logger.log(0, val, tables=tables)
        self._say_validation(0, val["val"], t0)

    def step(self, step: int, metrics: dict, timeline: Timeline, tables: dict, t0: float) -> None:
        """Step `step`'s metrics (`tables`: the held-out generations, when it validated); `t0`: the
        run's start, for the elapsed time on stderr."""
        media = self._timeline_media(step, timeline)
        if "val" in metrics:
            media["tables"] = {**media.get("tables", {}), **tables}
        self.logger.log(step, metrics, **media)
        print(f"[train] step {step}/{self.cfg.steps} reward {metrics['reward_mean']:.3f} "
              f"len {metrics['response_len_mean']:.1f} loss {metrics['loss']:+.4f} "
              f"grad {metrics['grad_norm']:.3f} dummy {metrics['dummy_share']:.1%} "
              f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
        if "val" in metrics:
            self._say_validation(step, metrics["val"], t0)

    def close(self) -> None:
        self.logger.close()

    def _say_validation(self, step: int, val: dict, t0: float) -> None:
        print(f"[train] step {step}/{self.cfg.steps} held-out pass@1 {val['pass@1']:.3f} reward "
              f"{val['reward_mean']:.3f} len {val['response_len_mean']:.2f} ({val['prompts']} prompts, "
              f"{time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)

    def _timeline_media(self, step: int, tl: Timeline) -> dict:
        """Every `logging.plot_every` steps: the step's rollout timeline, drawn to
        OUT/timelines/step<N>.png, and its segments, for the metrics logger."""
        every = self.cfg.logging.plot_every
        if not every or step % every:
            return {}
        tl.title = f"step {step}: {self.cfg.elastic.policy}"
        path = plot_timelines([tl], self.out_dir / "timelines" / f"step{step:06d}.png")
        return {"images": {"rollout_timeline": path}, "tables": {"rollout/timeline": (tl.columns(), tl.rows())}}
