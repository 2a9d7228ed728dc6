"""The process groups a rank computes with, passed as one object (never read from globals).

Field names follow megatron-core's `ProcessGroupCollection` (`ep`, `dp`, `tp`); `to_megatron()`
builds the real collection for the megatron-core backend. The CPU path does not import megatron-core
here because `import megatron.core` costs seconds per spawned rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProcessGroups:
    world: Any
    ep: Any
    dp: Any
    tp: Any = None

    def with_ep(self, ep: Any) -> "ProcessGroups":
        """The same collection with another EP group (how `elastic/` shrinks the group)."""
        return ProcessGroups(world=self.world, ep=ep, dp=self.dp, tp=self.tp)

    def to_megatron(self):
        from megatron.core.process_groups_config import ProcessGroupCollection

        kwargs = {"ep": self.ep, "dp": self.dp}
        if self.tp is not None:
            kwargs["tp"] = self.tp
        return ProcessGroupCollection(**kwargs)
