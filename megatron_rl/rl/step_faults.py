"""What stops a training step, said in one line: a collective that failed (a peer rank froze, died
or timed out) becomes a `StepFault` naming rank, step and phase, as the rollout's `ElasticFault`
names rank, stage and phase; a non-finite loss or gradient norm stops the run before the step is
saved. Bugs keep their traceback: only a collective's failure is translated.
"""
from __future__ import annotations

import contextlib
import math
import re
import time
from pathlib import Path

import torch.distributed as dist

from elastic.runtime.runtime import ElasticFault, fault_cause
from megatron_rl.errors import FlexFloorError
from megatron_rl.parallel.rank_failures import user_error
from megatron_rl.rl.checkpoint.dcp import latest_checkpoint

# What a collective that failed says (gloo, NCCL, the c10d store): a peer froze, died or timed out.
_COLLECTIVE = re.compile(r"[Tt]imed out|[Tt]imeout|Connection (closed|reset|refused)|NCCL|gloo|"
                         r"Broken pipe|peer|[Ss]ocket")


class TrainingDiverged(FlexFloorError):
    pass


class StepFault(RuntimeError):
    """A collective failed in a training step: one line naming rank, step and phase (what the
    launcher prints), as the rollout's `ElasticFault` names rank, stage and phase."""

    one_line = True


class StepPhases:
    """A training step's phases as they pass: the one in flight (what a fault's message names) and
    the seconds each finished one took."""

    def __init__(self, first: str):
        self.current = first
        self.seconds: dict[str, float] = {}
        self._since = time.perf_counter()

    def start(self, phase: str) -> None:
        """The phase in flight ends; `phase` starts."""
        self.end()
        self.current = phase

    def end(self) -> None:
        """The phase in flight ends: its seconds are recorded."""
        now = time.perf_counter()
        self.seconds[self.current] = now - self._since
        self._since = now


@contextlib.contextmanager
def step_faults(rank: int, step: int, timeout_s: float, phases: StepPhases):
    """Turn a failed collective inside the block into a `StepFault` naming this `rank`, `step` and
    the phase in flight (`phases.current` when it failed; `timeout_s`: the run's, for the message);
    bugs keep their traceback."""
    try:
        yield
    except ElasticFault as e:  # the rollout's own (rank, stage, phase); the step is what it lacks
        if user_error(e) is not None:  # a user's mistake travels as itself
            raise
        cause = str(e).split(": ", 1)[-1]
        raise StepFault(f"rank {e.rank}, step {step}, stage {e.stage}, phase {e.phase}: {cause}") from None
    except RuntimeError as e:
        if isinstance(e, StepFault) or not (isinstance(e, dist.DistError) or _COLLECTIVE.search(str(e))):
            raise
        raise StepFault(f"rank {rank}, step {step}, phase {phases.current}: {fault_cause(e)} "
                        f"(timeout_s {timeout_s:g}; a peer rank froze, died or is slower)") from None


def check_finite(step: int, metrics: dict, out_dir: Path) -> None:
    """Stop on a non-finite loss or gradient norm (the same on every rank: both are global), before
    the step is saved, so the last checkpoint stays the last good one."""
    bad = [f"{k} {metrics[k]}" for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])]
    if bad:
        last = latest_checkpoint(out_dir)
        raise TrainingDiverged(f"step {step}: non-finite {', '.join(bad)}; stopped without saving it "
                               f"(last good checkpoint: {last or 'none'})")
