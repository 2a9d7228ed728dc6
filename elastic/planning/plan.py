"""The plan: what the planner decides and what the runtime and the simulator both carry out.

A plan is data. It says where every response of the batch runs (`assignments`) and the quorum
schedule: a chain of stages `A_0 = all W ranks ⊋ A_1 ⊋ ... ⊋ A_k`, `|A_k| >= floor`. Stage i+1 may
start only once every rank in `stages[i+1].drained` has no live request; `owners` is the expert ->
ranks map that holds while the stage is active. The trigger rule (`advance`) and the expert moves of
a shrink (`transfers`) live here, so the runtime and the simulator cannot drift apart.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Iterable

from elastic.errors import InputError
from elastic.planning.dims import ParallelDims, contiguous_owners, divides, planned_dims


@dataclass(frozen=True)
class Assignment:
    prompt_id: str
    sample: int
    rank: int


@dataclass(frozen=True)
class Stage:
    members: tuple[int, ...]
    drained: tuple[int, ...]
    owners: dict[int, tuple[int, ...]]

    def owner_of(self, expert: int) -> int:
        """The rank that serves `expert` in this stage (the first listed; replicas are spares)."""
        return self.owners[expert][0]

    def to_dict(self) -> dict:
        return {
            "members": list(self.members),
            "drained": list(self.drained),
            "owners": {str(e): list(r) for e, r in sorted(self.owners.items())},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Stage":
        return cls(
            members=tuple(d["members"]),
            drained=tuple(d["drained"]),
            owners={int(e): tuple(r) for e, r in d["owners"].items()},
        )


@dataclass
class Plan:
    ranks: int
    floor: int
    num_experts: int
    layout: str
    tailguard: bool
    assignments: list[Assignment]
    stages: list[Stage]
    predicted_release_rank_s: float = 0.0
    meta: dict = field(default_factory=dict)
    ownership: str = "balanced"

    # ---- queries the runtime and simulator share --------------------------------------------
    @property
    def dims(self) -> ParallelDims:
        """The layout the plan is made for (its world need not divide the experts: `balanced`
        ownership holds uneven blocks or replicas)."""
        return planned_dims(self.ranks, self.num_experts, self.ownership)

    def rank_of(self) -> dict[tuple[str, int], int]:
        return {(a.prompt_id, a.sample): a.rank for a in self.assignments}

    def advance(self, current: int, drained: Iterable[int]) -> int:
        """The stage to be in, given stage `current` is active and the set of drained ranks.

        Stages are taken in order and never skipped over a trigger that has not fired: a rank that
        outlives its predicted length holds its stage (and every later one) back, it is never cut.
        """
        drained = set(drained)
        i = current
        while i + 1 < len(self.stages) and set(self.stages[i + 1].drained) <= drained:
            i += 1
        return i

    def transfers(self, src_stage: int, dst_stage: int) -> list[tuple[int, int, int]]:
        """Expert moves `(expert, from_rank, to_rank)` to go from one stage's owners to another's.

        An expert already held by a rank in the source stage is not sent to it again. The sender is
        the first source owner, which is what both sides can compute without talking.
        """
        src, dst = self.stages[src_stage], self.stages[dst_stage]
        moves = []
        for e in range(self.num_experts):
            have = set(src.owners[e])
            for r in dst.owners[e]:
                if r not in have:
                    moves.append((e, src.owners[e][0], r))
        return moves

    # ---- invariants -------------------------------------------------------------------------
    def check(self, batch: Iterable[tuple[str, int]] | None = None) -> None:
        """Raise ValueError if the plan breaks an invariant of docs/design.md."""
        if not self.stages:
            raise ValueError("plan has no stages")
        dims = self.dims
        if tuple(self.stages[0].members) != tuple(range(self.ranks)):
            raise ValueError(f"stage 0 must hold all {self.ranks} ranks, has {self.stages[0].members}")
        prev: set[int] | None = None
        for i, st in enumerate(self.stages):
            members = set(st.members)
            if len(members) != len(st.members):
                raise ValueError(f"stage {i}: duplicate members {st.members}")
            if len(members) < min(self.floor, self.ranks):
                raise ValueError(f"stage {i}: {len(members)} members is below the floor {self.floor}")
            if prev is not None:
                if not members < prev:
                    raise ValueError(f"stage {i}: members {sorted(members)} not a strict subset of {sorted(prev)}")
                if not (prev - members) <= set(st.drained):
                    raise ValueError(f"stage {i}: leaving ranks {sorted(prev - members)} are not all in its trigger")
            if set(st.owners) != set(range(self.num_experts)):
                raise ValueError(f"stage {i}: owners do not cover experts 0..{self.num_experts - 1}")
            for e, rs in st.owners.items():
                if not rs or not set(rs) <= members:
                    raise ValueError(f"stage {i}: expert {e} owned by {rs}, not within members")
            if dims.ownership == "blocks" and not (dims.allows_stage(len(members))
                                                   and st.owners == dims.block_owners(st.members)):
                raise ValueError(f"stage {i}: experts are not megatron-core's contiguous blocks over "
                                 f"{len(members)} members (ownership 'blocks')")
            prev = members
        seen: set[tuple[str, int]] = set()
        for a in self.assignments:
            if (a.prompt_id, a.sample) in seen:
                raise ValueError(f"response {(a.prompt_id, a.sample)} assigned twice")
            if not 0 <= a.rank < self.ranks:
                raise ValueError(f"response {(a.prompt_id, a.sample)} on rank {a.rank}, outside 0..{self.ranks - 1}")
            seen.add((a.prompt_id, a.sample))
        if batch is not None:
            missing = set(batch) - seen
            if missing:
                raise ValueError(f"{len(missing)} responses not assigned, e.g. {sorted(missing)[0]}")

    # ---- JSON -------------------------------------------------------------------------------
    # The fields, in order, are the JSON's keys: only the assignments and stages need converting.
    def to_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "assignments": [asdict(a) for a in self.assignments],
                "stages": [s.to_dict() for s in self.stages]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """A plan from `to_dict`'s keys; the ones with defaults may be absent (older files)."""
        d = {**d, "assignments": [Assignment(**a) for a in d["assignments"]],
             "stages": [Stage.from_dict(s) for s in d["stages"]]}
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def static_plan(layout: str, assignments: list[Assignment], ranks: int, num_experts: int) -> Plan:
    """A plan with a single stage: nobody leaves (the `vanilla` policy). Where the experts divide
    over the ranks its owners are megatron-core's blocks, so either backend runs it; elsewhere (a
    simulated world) contiguous blocks that differ by one expert, or replicas."""
    stage = Stage(members=tuple(range(ranks)), drained=(), owners=contiguous_owners(num_experts, range(ranks)))
    return Plan(ranks=ranks, floor=ranks, num_experts=num_experts, layout=layout, tailguard=False,
                assignments=assignments, stages=[stage],
                ownership="blocks" if divides(num_experts, ranks) else "balanced")


class PlanError(InputError, ValueError):
    """The inputs admit no safe plan (the floor cannot hold every expert, the KV cannot fit, ...);
    the message says which constraint failed and by how much."""
