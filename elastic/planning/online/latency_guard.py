"""The online rule's latency guard: two priced clocks and the time an option may take.

With `max_slowdown`, a decision of `online.rule.OnlineRule` may spend on releasing ranks only what the
rollout has gained on vanilla so far: both are priced at every check (this rollout's busiest member
in its group, vanilla's on verl's contiguous chunks of all W ranks), and `bound` turns that into
the longest remainder an option may be priced at.
"""
from __future__ import annotations

import math

import numpy as np

from elastic.planning.step_cost import StepCost, step_table


class LatencyGuard:
    def __init__(self, prompt: np.ndarray, ranks: int, cost: StepCost, max_slowdown: float | None):
        self.prompt, self.ranks, self.cost, self.max_slowdown = prompt, ranks, cost, max_slowdown
        # Vanilla's layout (verl's contiguous chunks of the batch) and two clocks, its and this
        # rollout's, priced at every check: the reference `max_slowdown` is measured against.
        sizes = [len(c) for c in np.array_split(np.arange(len(prompt)), ranks)]
        self.natural = np.repeat(np.arange(ranks), sizes)
        self.clock = {"own": 0.0, "vanilla": 0.0}
        self.clock_step = 0
        self.deadline = math.inf  # see `bound`

    def tick(self, g_own: int, step: int, live: np.ndarray, rank_of: np.ndarray, tokens: np.ndarray) -> None:
        """Advance both clocks to `step`: the steps since the last check, each priced at the
        busiest member's live batch and KV as they are now, this rollout's in its group, vanilla's
        on its chunks of all W ranks (the lengths do not depend on where a response runs)."""
        steps, self.clock_step = step - self.clock_step, step
        if self.max_slowdown is None or steps <= 0 or not len(live):  # nothing reads the clocks
            return
        held = self.prompt[live] + tokens[live]
        for name, ranks, g in (("own", rank_of[live], g_own),
                               ("vanilla", self.natural[live], self.ranks)):
            count = np.bincount(ranks, minlength=self.ranks)
            kv = np.bincount(ranks, held, minlength=self.ranks)
            b = max(int(count.max()), 1)
            self.clock[name] += steps * float(step_table(self.cost, np.array([b]), np.array([kv.max() / b]), g)[0])

    def spend(self, seconds: float) -> None:
        """Charge this rollout's clock what a decision's shrink and KV moves cost."""
        self.clock["own"] += seconds

    def bound(self, fastest_s: float) -> float:
        """The longest remainder an option may be priced at, given the fastest option's: within
        `max_slowdown` of it, or within the deadline. The deadline is the earliest finish ever
        promised: vanilla's priced clock (what it would have taken to here) plus the then fastest
        remainder, with `max_slowdown`, so what the layout and rebalances have gained on vanilla
        may be spent on releasing ranks, once: a shrink makes the later fastest slower, and a
        deadline taken from it would spend the same gain again. Only realised gains count: the
        sampled futures of vanilla's chunks run long (a hard prompt's samples share a rank there),
        and spending them measured up to 3% slower than vanilla."""
        margin = 1 + self.max_slowdown
        self.deadline = min(self.deadline, self.clock["vanilla"] + fastest_s * margin)
        return max(fastest_s * margin, self.deadline - self.clock["own"])
