"""What a scenario of the online rule (`online.rule.OnlineRule`) costs: "stage j from now, with these
requests moved", priced on the sampled future (`online.grid.Grid`) at each sample's busiest member.

Apart from the rule because these are the prices, fixed for one rollout (the ladder's shrink and
restore seconds, memoised step seconds), while the rule decides which scenarios to compare and
when; both price a step as `StepCost.decode_step_s` (`step_table`) and a batch of KV moves by its
busiest rank's share (`elastic.planning.busiest`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from elastic.planning.busiest import busiest_load
from elastic.planning.chains.estimate import Estimate
from elastic.planning.online.grid import Grid, batch_context
from elastic.planning.plan import Plan
from elastic.planning.shape import ModelShape
from elastic.planning.step_cost import StepCost, step_table


def migrate_s(cost: StepCost, kv_bytes: float, ep_size: int) -> float:
    """Seconds to move KV cache inside a group of `ep_size`, `kv_bytes` being what the busiest rank
    sends or receives (0 for a cost model that does not price it)."""
    price = getattr(cost, "migrate_s", None)
    return float(price(kv_bytes, ep_size)) if price is not None else 0.0


class Prices:
    """The prices of one rollout's scenarios, on the stages of its (laddered) plan."""

    def __init__(self, plan: Plan, prompt_len: Sequence[int], cost: StepCost, shape: ModelShape):
        self.plan, self.cost, self.shape = plan, cost, shape
        self.prompt = np.asarray(prompt_len, float)
        self.sizes = [len(s.members) for s in plan.stages]
        self.moves_to = {}  # (from stage, to stage) -> experts moved
        self.restore_s = [0.0] + [cost.shrink_s(self.moved(j, 0), self.sizes[j]) for j in range(1, len(plan.stages))]
        self.step_memo: dict[int, dict[tuple[int, int], float]] = {}  # g -> (batch, context/64) -> s

    def moved(self, a: int, b: int) -> int:
        """Experts moved from stage a to stage b."""
        if (a, b) not in self.moves_to:
            self.moves_to[(a, b)] = len(self.plan.transfers(a, b))
        return self.moves_to[(a, b)]

    @staticmethod
    def estimate(total_s: np.ndarray, until_s: np.ndarray, g0: int, g: int, W: int) -> list[Estimate]:
        """Each column's remainder of the rollout as the planner scores it (mean over the sample
        rows): the current group of g0 until `until_s`, g ranks after; ranks already detached stay so."""
        total_s, until_s = total_s.reshape(len(total_s), -1), until_s.reshape(len(until_s), -1)
        T = total_s.mean(axis=0)
        detached = (W - g0) * T + (g0 - g) * (total_s - until_s).mean(axis=0)
        return [Estimate(float(t), float(t), float(x), float(W * t - x)) for t, x in zip(T, detached)]

    def steps(self, batch: np.ndarray, context: np.ndarray, g: int) -> np.ndarray:
        """Step seconds per segment, memoised for the rollout (context to 64 tokens, where the step
        changes little)."""
        keys = list(zip(np.rint(batch).astype(int).tolist(), (context.astype(int) >> 6).tolist()))
        memo = self.step_memo.setdefault(g, {})
        missing = sorted(set(keys) - memo.keys())
        if missing:
            b, c = np.array(missing).T
            memo.update(zip(missing, step_table(self.cost, b, (c << 6) + 32, g).tolist()))
        return np.array([memo[k] for k in keys])

    def exact(self, stage: int, j: int, grid: Grid, live, rank_of, moves, tokens,
              horizon: float | None = None) -> Estimate:
        """The remainder of the rollout if stage j starts now with `moves` made, each sample priced
        with its own busiest member (with `horizon`: only its next `horizon` steps, no restore)."""
        where = dict(zip(live.tolist(), rank_of[live].tolist()))
        for i, r in moves:
            where[i] = r
        count, kv = grid.per_rank(np.array([where[i] for i in live.tolist()]))
        kept = list(self.plan.stages[j].members)
        g0, g = self.sizes[stage], self.sizes[j]
        tau = self.steps(*batch_context(count[:, :, kept].max(axis=2), kv[:, :, kept].max(axis=2)), g)
        shrink = (self.cost.shrink_s(self.moved(stage, j), g0) if j != stage else 0.0) \
            + migrate_s(self.cost, self.busiest_bytes(moves, rank_of, tokens), g0)
        seg, restore = grid.seg, self.restore_s[j]
        if horizon is not None:
            start = grid.bounds[:-1][None, :]
            seg, restore = np.clip(np.minimum(seg + start, horizon) - start, 0.0, None), 0.0
        total = (seg * tau[None, :]).sum(axis=1) + shrink + restore
        return self.estimate(total, np.full(len(total), shrink), g0, g, self.plan.ranks)[0]

    def busiest_bytes(self, moves, rank_of, tokens) -> float:
        """KV bytes the busiest rank sends or receives in `moves`. Moves between distinct pairs run
        at once, so a batch of moves takes about as long as its busiest rank's share
        (`elastic.planning.busiest`)."""
        held = ((int(rank_of[i]), int(r), float(self.prompt[i] + tokens[i])) for i, r in moves)
        return busiest_load(held) * self.shape.kv_bytes_per_token
