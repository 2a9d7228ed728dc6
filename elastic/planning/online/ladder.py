"""The ladder: the stages the online rule (`online.rule.OnlineRule`) may choose, fixed before the rollout.

The offline plan (`make_plan`) is the starting point: its layout, and its order of leaving ranks.
`ladder_plan` turns it into a plan whose stages are every candidate group size of that order
(`schedule.candidate_sizes`, W down to the floor), so the stage groups the rule may choose are known
before the first decode step and can be created up front: at most `FINE_SPAN + 1` groups for worlds
within 16 ranks of their floor, `MAX_CANDIDATES + 1` beyond (docs/planner.md). Stages are prefixes
of one order, so they are nested, and each stage's owners come from the chain through every
smaller ladder step, so every expert is owned in every stage whichever stage is jumped to.
"""
from __future__ import annotations

from elastic.planning.chains.schedule import build_stages, candidate_sizes
from elastic.planning.dims import planned_dims
from elastic.planning.plan import Plan


def leave_order(plan: Plan) -> list[int]:
    """The plan's ranks, those that stay longest first (`meta["leave_order"]` for one-stage plans)."""
    if len(plan.stages) == 1:
        return list(plan.meta.get("leave_order", range(plan.ranks)))
    order = list(plan.stages[-1].members)
    for st in reversed(plan.stages[1:]):
        order += list(st.drained)
    return order


def ladder_plan(plan: Plan, floor: int) -> Plan:
    """`plan` with a stage for every candidate group size down to `floor`, in its leaving order."""
    dims = planned_dims(plan.ranks, plan.num_experts)  # a ladder's stages are `balanced`
    sizes = [plan.ranks] + (candidate_sizes(dims, floor) if floor < plan.ranks else [])
    stages = build_stages(sizes, plan.num_experts, leave_order(plan))
    meta = dict(plan.meta, ladder=sizes, offline_chain=[len(s.members) for s in plan.stages])
    out = Plan(plan.ranks, floor, plan.num_experts, plan.layout, plan.tailguard, plan.assignments,
               stages, plan.predicted_release_rank_s, meta)
    out.check()
    return out
