"""The parallel layout of a job, validated once, that every command asks (torchtitan's `ParallelDims`).

FlexFloor's layout is expert parallelism over the whole world with the dense weights replicated:
EP = DP = the world. Every rank owns `experts / world` experts at the start and the end of every
rollout, so the experts must divide over the ranks. A stage of an elastic rollout is a subgroup of
the world; which sizes it may have depends on the backend's expert ownership (`OWNERSHIPS`): any
with `balanced` (plain PyTorch), only those the experts divide over with `blocks` (megatron-core's
equal contiguous blocks, `block_owners`). Every divisibility rule of the layout lives here; which
ownership a backend needs is decided once, in `megatron_rl/parallel/dims.py`.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from elastic.errors import InputError

# How a plan's stages own experts: `balanced` (any group size; a shrink moves the fewest experts;
# the torch backend) or `blocks` (megatron-core's MoELayer: every stage is `block_owners` of its
# members, so only group sizes that divide the expert count; the megatron backend).
OWNERSHIPS = ("balanced", "blocks")



class LayoutError(InputError, ValueError):
    """A layout no rank can run (a config's mistake; the CLI reports it in one line)."""


def divides(count: int, size: int) -> bool:
    """Whether `count` things split over `size` holders in equal shares: the one divisibility rule."""
    return count % size == 0


def block_owners(num_experts: int, members: Iterable[int]) -> dict[int, tuple[int, ...]]:
    """Megatron's default EP ownership: contiguous blocks of E/|members| experts per member."""
    members = sorted(members)
    if not divides(num_experts, len(members)):
        raise LayoutError(f"{num_experts} experts do not divide over {len(members)} ranks "
                          "(megatron-core owns experts in equal contiguous blocks)")
    per = num_experts // len(members)
    return {e: (members[e // per],) for e in range(num_experts)}


def contiguous_owners(num_experts: int, members) -> dict[int, tuple[int, ...]]:
    """`block_owners` generalised to any group size (equal to it when |members| divides E)."""
    members = sorted(members)
    g = len(members)
    if divides(num_experts, g):
        return block_owners(num_experts, members)
    if num_experts > g:
        # Blocks of ceil/floor size, larger ones first, contiguous in expert index.
        base, extra = divmod(num_experts, g)
        owners, e = {}, 0
        for j, r in enumerate(members):
            for _ in range(base + (1 if j < extra else 0)):
                owners[e] = (r,)
                e += 1
        return owners
    # More ranks than experts: member j holds expert floor(j * E / g), every expert replicated.
    owners: dict[int, list[int]] = {e: [] for e in range(num_experts)}
    for j, r in enumerate(members):
        owners[j * num_experts // g].append(r)
    return {e: tuple(rs) for e, rs in owners.items()}


def check_floor(floor: int, world: int, name: str = "floor") -> None:
    """The floor's range: at least one rank, at most the world (`name`: the field, for the error)."""
    if not 1 <= floor <= world:
        raise LayoutError(f"{name}: expected 1..ranks ({world}), got {floor}")


@dataclass(frozen=True)
class ParallelDims:
    world: int  # ranks
    experts: int  # the model's routed experts
    ownership: str = "balanced"  # `OWNERSHIPS`: how a backend may place experts over a stage
    ranks_per_node: int = 0  # ranks that share one host (0: all of them)
    source: str = field(default="num_experts", compare=False)  # where `experts` came from, for errors
    # False only for a world the planner or simulator studies without ranks to run it: `balanced`
    # ownership may then hold the experts in uneven blocks, or replicate them over more ranks.
    even: bool = True

    def __post_init__(self):
        if self.world < 1:
            raise LayoutError(f"ranks: expected > 0, got {self.world}")
        if self.ownership not in OWNERSHIPS:
            raise LayoutError(f"ownership: expected one of {', '.join(OWNERSHIPS)}, got {self.ownership!r}")
        if self.even:
            if self.world > self.experts:
                raise LayoutError(f"ranks: expected at most {self.experts} (the model's experts in "
                                  f"{self.source}: every rank owns one), got {self.world}")
            if not divides(self.experts, self.world):
                raise LayoutError(f"{self.source}: expected a multiple of ranks ({self.world}), got {self.experts}: "
                                  "the model's experts divide over the ranks")
        self.check_stage(self.world)
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
        return 1 <= size <= self.world and (self.ownership != "blocks" or divides(self.experts, size))

    def check_stage(self, size: int) -> None:
        """Raise LayoutError, saying why, unless a stage of `size` ranks can hold every expert."""
        if not 1 <= size <= self.world:
            raise LayoutError(f"a stage of {size} ranks is outside 1..{self.world} (the ranks)")
        if not self.allows_stage(size):
            block_owners(self.experts, range(size))  # raises the blocks' reason

    def check_floor(self, floor: int, name: str = "floor") -> None:
        check_floor(floor, self.world, name)

    def stage_sizes(self, floor: int = 1) -> list[int]:
        """The stage sizes the ownership allows from the world down to `floor`, largest first (the
        world is always one)."""
        return [n for n in range(self.world, floor - 1, -1) if self.allows_stage(n)]

    def block_owners(self, members: Iterable[int]) -> dict[int, tuple[int, ...]]:
        """megatron-core's contiguous blocks of this model's experts over `members`."""
        return block_owners(self.experts, members)


def planned_dims(world: int, experts: int, ownership: str = "balanced") -> ParallelDims:
    """The layout of a world only planned or simulated, with no ranks to run it (`ParallelDims.even`
    False): a plan's own (`Plan.dims`), the online rule's ladder and the simulator's. A command's
    layout, for ranks that run, is `megatron_rl/parallel/dims.py`'s."""
    return ParallelDims(world, experts, ownership, even=False)
