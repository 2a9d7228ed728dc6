"""End rules a rollout's members may apply at a status check, before every request has finished.

A partial rollout (docs/training.md, *Partial rollouts*) ends the decode loop once enough groups
(the samples of one prompt) have no live request: `ElasticRuntime`'s `stop(engine, group)` asks
`GroupsStop`, which counts the live requests per group in one collective over the current group.
The rules of what a group is and how many must be complete are `elastic.planning.partial`'s.
"""
from __future__ import annotations

import torch

from elastic.planning.partial import groups_complete


class GroupsStop:
    """The `groups` end rule at a status check: one all-reduce of the live requests per group over
    the current group (the members hold every live request), then stop once `target` groups have
    none. Every member gets the same counts, so all end the loop at the same tick. `engine` is the
    rank's rollout engine: its `pending` and `live` requests carry their `key`."""

    def __init__(self, engine, group_of: dict[tuple[str, int], int], groups: int, target: int):
        self.engine, self.group_of, self.groups, self.target = engine, group_of, groups, target
        self.complete = 0

    def __call__(self, elastic, group) -> bool:
        counts = torch.zeros(self.groups, dtype=torch.long)
        for r in self.engine.pending + self.engine.live:
            counts[self.group_of[r.key]] += 1
        counts = elastic.transport.all_reduce(counts.to(elastic.device), group).cpu()
        self.complete = groups_complete(counts.numpy())
        return self.complete >= self.target


def batch_stop(rule, keys: list[tuple[str, int]], engine) -> GroupsStop:
    """`flexfloor rollout`'s end rule: its batch is one rollout's launched groups (the samples of
    each prompt), so the target is the most groups for which `rule` launches no more than those."""
    index = {pid: i for i, pid in enumerate(dict.fromkeys(pid for pid, _ in keys))}
    groups = len(index)
    target = max((t for t in range(1, groups + 1) if rule.launch_count(t) <= groups), default=groups)
    return GroupsStop(engine, {k: index[k[0]] for k in keys}, groups, target)
