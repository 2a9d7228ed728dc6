"""Process groups made once per world and member set.

`torch.distributed.new_group` is a collective: every rank must create the same groups in the same
order, and creating one per rollout would be a rendezvous per training step. So a group of ranks is
made at most once, the first time any floor asks for it (a stage of the elastic runtime, the size-1
groups megatron-core's layers need), and kept for the life of the world. One key for every group:
the sorted member tuple, under the world's default group object itself (not its id, which a later
world may reuse); a new world starts the cache empty.
"""
from __future__ import annotations

import torch.distributed as dist

_cache: dict = {"world": None, "groups": {}, "warmed": set()}


def _current() -> dict:
    if _cache["world"] is not dist.group.WORLD:
        _cache.update(world=dist.group.WORLD, groups={}, warmed=set())
    return _cache


def process_group(members) -> object:
    """The group of exactly `members`, created on first use (call it on every rank, in one order)."""
    key = tuple(sorted(members))
    groups = _current()["groups"]
    if key not in groups:
        groups[key] = dist.new_group(list(key))
    return groups[key]


def first_use(members) -> bool:
    """True the first time it is asked for `members` in this world: the caller then warms the group
    with a collective, once, so that no communicator is created later in the middle of a shrink."""
    key, warmed = tuple(sorted(members)), _current()["warmed"]
    if key in warmed:
        return False
    warmed.add(key)
    return True


def forget() -> None:
    """Drop every group this cache made, before the world is destroyed: the last references to
    their backends go now, so their threads end while the interpreter is whole, not in its
    finalization, where a rank that finished its work could still abort on the way out."""
    _cache.update(world=None, groups={}, warmed=set())
