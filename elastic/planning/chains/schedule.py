"""Quorum schedules: the safe chains of active groups from all W ranks down to at least the floor.

Conventions that make a chain cheap to carry out:
- the ranks leave in one fixed order whatever the chain: stage i keeps the first g_i ranks of a
  staying order (by default 0..g_i-1, which is what `planned` lays out for: the longest work on the
  lowest ranks, and a prefix of one node stays inside one NVLink domain as the group shrinks; for
  `natural` and `lengthsort` the planner orders the ranks by their predicted drain, latest first);
- stage 0 is Megatron's contiguous ownership (`block_owners`) so the runtime starts from the
  ordinary layout; a group size that does not divide the expert count gets contiguous blocks that
  differ by one expert, or, with more ranks than experts, contiguous replicas;
- a shrink keeps every survivor's experts where they are and moves only the experts that no survivor
  already holds (fewest moves), each to the least-loaded survivor; a survivor above the balanced
  share ceil(E / g) drops replicas that another survivor also holds (dropping moves nothing).

Candidate group sizes: every size from W - 1 down to the floor when there are at most `FINE_SPAN`
of them (ranks may leave one by one; sizes that do not divide the expert count get blocks that
differ by one expert); beyond that, the sizes that divide the expert count, or that the expert
count divides and that divide W (even replicas), plus the floor, thinned to a halving ladder from W
when there are more than `MAX_CANDIDATES`, so the search stays small at 256 ranks.

Ownership `blocks` (the megatron backend: megatron-core's MoELayer fixes each EP rank's experts at
construction as one contiguous block, `block_owners`) admits only group sizes that divide the expert
count, and every stage is `block_owners` of its members, so a shrink moves every expert whose
block changes hands, not only the leaving ranks' ones.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import combinations

from elastic.planning.dims import ParallelDims, block_owners, contiguous_owners, divides
from elastic.planning.plan import Stage

MAX_CANDIDATES = 6
FINE_SPAN = 16


def held_counts(owners: dict[int, tuple[int, ...]], members) -> dict[int, int]:
    held = dict.fromkeys(members, 0)
    for rs in owners.values():
        for r in rs:
            held[r] += 1
    return held


def shrink_owners(owners: dict[int, tuple[int, ...]], survivors) -> dict[int, tuple[int, ...]]:
    """Ownership after a shrink to `survivors`: fewest expert moves, balanced (see module doc)."""
    survivors = sorted(survivors)
    alive = set(survivors)
    keep = {e: [r for r in rs if r in alive] for e, rs in owners.items()}
    held = held_counts({e: tuple(rs) for e, rs in keep.items()}, survivors)
    target = math.ceil(len(owners) / len(survivors))
    # Drop surplus replicas from overloaded survivors first, so orphans can land there evenly.
    for e in sorted(keep):
        rs = keep[e]
        for r in sorted(rs, key=lambda r: -held[r]):
            if len(rs) > 1 and held[r] > target:
                rs.remove(r)
                held[r] -= 1
    for e in sorted(keep):
        if not keep[e]:
            r = min(survivors, key=lambda r: (held[r], r))
            keep[e].append(r)
            held[r] += 1
    return {e: tuple(rs) for e, rs in keep.items()}


def candidate_sizes(dims: ParallelDims, floor: int) -> list[int]:
    """Group sizes a chain may pass through below the world, largest first (with `balanced`
    ownership always including the floor; with `blocks` only the stage sizes `dims` allows)."""
    ranks, num_experts = dims.world, dims.experts
    if dims.ownership == "blocks":
        sizes = set(dims.stage_sizes(floor)[1:])
    elif ranks - floor <= FINE_SPAN:
        return list(range(ranks - 1, floor - 1, -1))
    else:
        sizes = {g for g in range(floor, ranks)
                 if divides(num_experts, g) or (divides(g, num_experts) and divides(ranks, g))}
        if floor < ranks:
            sizes.add(floor)
    out = sorted(sizes, reverse=True)
    if len(out) > MAX_CANDIDATES:
        ladder, g = {out[-1]}, ranks // 2
        while g > out[-1] and len(ladder) < MAX_CANDIDATES:
            ladder.add(max(s for s in out if s <= g))
            g //= 2
        out = sorted(ladder, reverse=True)
    return out


def chains(dims: ParallelDims, floor: int) -> Iterator[list[int]]:
    """Every chain of group sizes [W, g_1, ..., g_k] with W > g_1 > ... > g_k >= floor; the
    one-stage chain [W] (nobody leaves) comes first."""
    cands = candidate_sizes(dims, floor)
    for k in range(len(cands) + 1):
        for combo in combinations(cands, k):
            yield [dims.world, *combo]


def build_stages(sizes: list[int], num_experts: int, order: list[int] | None = None,
                 memo: dict | None = None, ownership: str = "balanced") -> list[Stage]:
    """Stages of the chain `sizes`; stage i holds order[:sizes[i]] (default: ranks 0..g-1).

    `memo` (one per `order` and `ownership`) shares the stages of common chain prefixes between
    calls."""
    order = list(range(sizes[0])) if order is None else list(order)
    memo = {} if memo is None else memo
    key = (sizes[0],)
    if key not in memo:
        memo[key] = Stage(tuple(range(sizes[0])), (), contiguous_owners(num_experts, range(sizes[0])))
    stages = [memo[key]]
    for g in sizes[1:]:
        prev = stages[-1]
        key = (*key, g)
        if key not in memo:
            members = tuple(sorted(order[:g]))
            leaving = tuple(sorted(set(prev.members) - set(members)))
            owners = (block_owners(num_experts, members) if ownership == "blocks"
                      else shrink_owners(prev.owners, members))
            memo[key] = Stage(members, leaving, owners)
        stages.append(memo[key])
    return stages
