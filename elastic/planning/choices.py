"""The names a command or a config may choose for the planner's layout and its chain objective, and
what a run chooses for the planner beside its policy's layout (`PlanChoices`).

Apart from the modules that define them (each layout in layout.py, `layout_kind`; each objective in
chains/search.py, `objective_key`), which import numpy and the planner: the CLIs' choices and their
configs' fields read the names here, so that `flexfloor --help` imports neither, and policies.py,
which imports the planner where a plan is made, is not tied to them.
"""
from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("natural", "lengthsort", "planned")
OBJECTIVES = ("occupied", "rollout")


@dataclass(frozen=True)
class PlanChoices:
    """A run's choices for the planner: the floor the group may shrink to (None: the policy's
    default, `PolicyKind.floor`), TailGuard, the chain objective (one of `OBJECTIVES`), TailGuard's
    miss rate `alpha` (the quantile that sizes KV without it), and the seed of the length samples."""

    floor: int | None
    tailguard: bool
    objective: str = "occupied"
    alpha: float = 0.05
    seed: int = 0
