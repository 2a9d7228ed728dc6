"""What a plan is priced on, decided once per command (or per simulated trace) and passed down to
the planner and its chain search: the ranks' layout, the model's shape, the device memory every
check prices weights, experts and KV against, and the step cost chains are timed with.
"""
from __future__ import annotations

from dataclasses import dataclass

from elastic.planning.dims import ParallelDims
from elastic.planning.shape import MemoryBudget, ModelShape
from elastic.planning.step_cost import ShapeCost, StepCost


@dataclass(frozen=True)
class Platform:
    dims: ParallelDims  # the ranks, and the expert ownership their backend carries out
    shape: ModelShape
    cost: StepCost | None = None  # None: the planner's own estimate from the shape (`ShapeCost`)
    budget: MemoryBudget | None = None  # None: the shape's (`ModelShape.budget`)

    def __post_init__(self):
        if self.cost is None:
            object.__setattr__(self, "cost", ShapeCost(self.shape))
        if self.budget is None:
            object.__setattr__(self, "budget", self.shape.budget)
