"""What stops a training step, said in one line: a collective that failed (a peer rank froze, died
or timed out) becomes a `StepFault` naming rank, step and phase, as the rollout's `ElasticFault`
names rank, stage and phase; a non-finite loss or gradient norm stops the run before the step is
saved. Bugs keep their traceback: only a collective's failure is translated.
"""
from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path

import torch.distributed as dist

from megatron_rl.errors import FlexFloorError
from megatron_rl.rl.checkpoint import latest_checkpoint

# What a collective that failed says (gloo, NCCL, the c10d store): a peer froze, died or timed out.
_COLLECTIVE = re.compile(r"[Tt]imed out|[Tt]imeout|Connection (closed|reset|refused)|NCCL|gloo|"
                         r"Broken pipe|peer|[Ss]ocket")


class TrainingDiverged(FlexFloorError):
    pass


class StepFault(RuntimeError):
    """A collective failed in a training step: one line naming rank, step and phase (what the
    launcher prints), as the rollout's `ElasticFault` names rank, stage and phase."""

    one_line = True


@contextlib.contextmanager
def step_faults(trainer, step: int, phase: str | None = None):
    """Turn a failed collective inside the block into a `StepFault`; bugs keep their traceback.
    `trainer`: the `Trainer` whose step runs (its rank, phase in flight and `timeout_s`)."""
    from elastic.runtime.runtime import ElasticFault, fault_cause

    if phase is not None:
        trainer.phase = phase
    try:
        yield
    except ElasticFault as e:  # the rollout's own (rank, stage, phase); the step is what it lacks
        from megatron_rl.parallel.rank_failures import user_error

        if user_error(e) is not None:  # a user's mistake travels as itself
            raise
        cause = str(e).split(": ", 1)[-1]
        raise StepFault(f"rank {e.rank}, step {step}, stage {e.stage}, phase {e.phase}: {cause}") from None
    except RuntimeError as e:
        if isinstance(e, StepFault) or not (isinstance(e, dist.DistError) or _COLLECTIVE.search(str(e))):
            raise
        raise StepFault(f"rank {trainer.rank}, step {step}, phase {trainer.phase}: {fault_cause(e)} "
                        f"(timeout_s {trainer.cfg.timeout_s:g}; a peer rank froze, died or is slower)") from None


def check_finite(step: int, metrics: dict, out_dir: Path) -> None:
    """Stop on a non-finite loss or gradient norm (the same on every rank: both are global), before
    the step is saved, so the last checkpoint stays the last good one."""
    bad = [f"{k} {metrics[k]}" for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])]
    if bad:
        last = latest_checkpoint(out_dir)
        raise TrainingDiverged(f"step {step}: non-finite {', '.join(bad)}; stopped without saving it "
                               f"(last good checkpoint: {last or 'none'})")
