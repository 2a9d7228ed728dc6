"""The parallel layout of a job, validated once, that every command asks (torchtitan's `ParallelDims`).

FlexFloor's layout is expert parallelism over the whole world with the dense weights replicated:
EP = DP = the world. Every rank owns `experts / world` experts at the start and the end of every
rollout, so the experts must divide over the ranks: that rule lives here only. A stage of an
elastic rollout is a subgroup of the world; which sizes it may have depends on the backend's expert
ownership (`plan.BACKEND_OWNERSHIP`): any with `balanced` (plain PyTorch), only those the experts
divide over with `blocks` (megatron-core's equal contiguous blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from elastic.errors import InputError


class LayoutError(InputError, ValueError):
    """A layout no rank can run (a config's mistake; the CLI reports it in one line)."""


@dataclass(frozen=True)
class ParallelDims:
    world: int  # ranks
    experts: int  # the model's routed experts
    ownership: str = "balanced"  # `plan.OWNERSHIPS`: how a backend may place experts over a stage
    ranks_per_node: int = 0  # ranks that share one host (0: all of them)
    source: str = field(default="num_experts", compare=False)  # where `experts` came from, for errors

    def __post_init__(self):
        if self.world < 1:
            raise LayoutError(f"ranks must be > 0, got {self.world}")
        if self.world > self.experts:
            raise LayoutError(f"ranks ({self.world}) exceeds the model's experts ({self.experts}) in "
                              f"{self.source}; every rank must own one")
        if self.experts % self.world:
            raise LayoutError(f"{self.source} ({self.experts}) must be divisible by ranks ({self.world}): "
                              "the model's experts must divide over the ranks")
        if not self.ranks_per_node:
            object.__setattr__(self, "ranks_per_node", self.world)

    @property
    def ep(self) -> int:
        """The EP group's size outside the elastic rollout (training, and every rollout's start and end)."""
        return self.world

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the dense weights: every rank."""
        return self.world

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.world

    def allows_stage(self, size: int) -> bool:
        """Whether a stage of `size` ranks can hold every expert under this ownership."""
        return 1 <= size <= self.world and (self.ownership != "blocks" or self.experts % size == 0)

    def stage_sizes(self) -> list[int]:
        """The stage sizes the backend allows, largest first (the world is always one)."""
        return [n for n in range(self.world, 0, -1) if self.allows_stage(n)]
