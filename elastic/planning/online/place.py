"""Where the online rule puts live requests: the leaving ranks' requests dealt over the members
that stay (`deal`, the vectorised estimate `OnlineRule` prices options with), the exact
placement under each member's KV budget and slot count (`place`, the moves a decision makes),
and the decision itself with the invariants its moves keep (`Decision`, `check_decision`); what a
decision reads of the rollout at one check is a `LiveState`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from elastic.planning.plan import Plan


@dataclass(frozen=True)
class LiveState:
    """The rollout at one status check, as a decision reads it: the live responses (indices,
    `live`), the rank holding each response (`rank_of`) and its tokens so far (`tokens`, every
    response), and the live ones' sampled remaining lengths (`rem`: samples x live)."""

    live: np.ndarray
    rank_of: np.ndarray
    tokens: np.ndarray
    rem: np.ndarray


@dataclass(frozen=True)
class Decision:
    stage: int
    # (response index, destination rank): made before the stage changes, or, staying, a rebalance.
    moves: tuple[tuple[int, int], ...] = ()
    kv_bytes: int = 0  # KV cache the moves carry


def member_mask(members, world: int) -> np.ndarray:
    """(world,) True at each of `members`: `member_mask(...)[ranks]` says which requests sit on a
    member, a lookup where `np.isin` sorts."""
    mask = np.zeros(world, dtype=bool)
    mask[list(members)] = True
    return mask


def deal(plan: Plan, j: int, ranks: np.ndarray, rem: np.ndarray) -> np.ndarray:
    """`ranks` (of the live requests) with those outside stage j dealt to its members: longest
    expected remainder first, in snake order over the members, least loaded first (what
    `place` does, without its KV checks, in one vectorised pass)."""
    kept = np.array(plan.stages[j].members)
    out = np.array(ranks)
    moving = np.nonzero(~member_mask(kept, plan.ranks)[out])[0]
    if not len(moving):
        return out
    mean = rem.mean(axis=0)
    load = np.bincount(out, weights=mean, minlength=plan.ranks)[kept]
    members = kept[np.argsort(load, kind="stable")]
    moving = moving[np.argsort(-mean[moving], kind="stable")]
    k = np.arange(len(moving))
    pos = k % len(kept)
    back = (k // len(kept)) % 2 == 1
    pos[back] = len(kept) - 1 - pos[back]
    out[moving] = members[pos]
    return out


def place(plan: Plan, j: int, now: LiveState, budget: dict[int, float], prompt: np.ndarray,
          max_batch: int | None, held: Callable, rebalance: bool = False) -> list[tuple[int, int]] | None:
    """Destinations of the live requests on ranks leaving for stage j (with `rebalance`, of
    every live request): longest expected remainder first, each to the member with the least
    expected remaining work whose KV budget (and slot count, `max_batch`) holds it (a request
    is reserved its tokens so far plus its longest sampled remainder, in the KV positions
    `held(positions, more)` gives under the run's cache, `KVUnit.held`). Only requests whose
    rank changes are listed."""
    live, rank_of, tokens, rem = now.live, now.rank_of, now.tokens, now.rem
    kept = list(plan.stages[j].members)
    mean, top = rem.mean(axis=0), rem.max(axis=0)
    work = dict.fromkeys(kept, 0.0)
    kv = dict.fromkeys(kept, 0.0)
    count = dict.fromkeys(kept, 0)
    slots = max_batch or len(live)
    placing = []
    for col, i in enumerate(live):
        r = int(rank_of[i])
        need = held(prompt[i] + tokens[i], top[col])
        if r in work and not rebalance:
            work[r] += mean[col]
            kv[r] += need
            count[r] += 1
        else:
            placing.append((mean[col], need, int(i)))
    moves = []
    for m, need, i in sorted(placing, key=lambda x: (-x[0], x[2])):
        room = [r for r in kept if kv[r] + need <= budget[r] and count[r] < slots]
        if not room:
            return None
        r = min(room, key=lambda r: (work[r], r))
        work[r] += m
        kv[r] += need
        count[r] += 1
        if r != rank_of[i]:
            moves.append((i, r))
    return moves


def check_decision(plan: Plan, stage: int, decision: Decision, rank_of: Sequence[int],
                   done: Sequence[bool]) -> None:
    """Raise ValueError if carrying out `decision` would break an invariant of docs/design.md: the
    stage goes back up, a rank leaves with a live request, or a request moves outside the group."""
    if not stage <= decision.stage < len(plan.stages):
        raise ValueError(f"decision goes from stage {stage} to {decision.stage}")
    kept = member_mask(plan.stages[decision.stage].members, plan.ranks)
    where = np.array(rank_of, dtype=np.int64)
    for i, r in decision.moves:
        if done[i]:
            raise ValueError(f"response {i} is finished and cannot move")
        if not (0 <= r < plan.ranks and kept[r]):
            raise ValueError(f"response {i} moves to rank {r}, outside stage {decision.stage}")
        where[i] = r
    stranded = np.flatnonzero(~np.asarray(done, dtype=bool) & ~kept[where])
    if len(stranded):
        raise ValueError(f"{len(stranded)} live requests (e.g. {stranded[0]}) would leave with their rank")
