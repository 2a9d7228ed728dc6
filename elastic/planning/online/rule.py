"""Online re-planning: the decision rule the runtime and the simulator both run at every status check.

The rule chooses among the stages of a laddered plan (`ladder.ladder_plan`: every candidate group
size, nested, each owning every expert), and prices its scenarios with `online.price.Prices`.

`OnlineRule.decide` looks at the live state (which rank holds which response, tokens so far, which
finished) and chooses the stage to be in, never going back up. A shrink to stage j makes the ranks
outside it leave; their live requests move first, with their KV cache, to members of j
(`Decision.moves`), so no rank leaves with a live request. Each choice is priced on joint samples
of the remaining lengths (`remaining.OnlineModel`): the rollout's remaining steps are fixed per sample
(moving a request does not change its length), and a step costs `StepCost.decode_step_s` at the
busiest member's live batch, so a scenario "stay in the current group until step D, then move to j"
costs its steps at each group's price, plus the shrink (`shrink_s`), the KV moved (`migrate_s`)
and the restore it commits to. The rule acts only when shrinking now beats every later shrink it
prices (D = one check, then doubling) and staying, under the same objective as `make_plan`
(`chains.search.objective_key`: fewest occupied rank-seconds, or the shortest rollout), and, with
`max_slowdown`, only within the time it may spend (`LatencyGuard.bound`: what the rollout has gained
on vanilla so far, priced on both clocks, plus the margin). Between shrinks it rebalances: live
requests move inside the group so the KV its members hold over the next checks is even
(`rebalance.even_out`, priced by `OnlineRule._rebalance`), since a step waits for the member holding the most.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from elastic.planning.chains.estimate import Estimate
from elastic.planning.chains.schedule import held_counts
from elastic.planning.chains.search import objective_key
from elastic.planning.lengths.remaining import OnlineModel
from elastic.planning.memory.kv_unit import TOKENS, KVUnit, slot_len
from elastic.planning.online.grid import Grid
from elastic.planning.online.latency_guard import LatencyGuard
from elastic.planning.online.place import Decision, LiveState, place
from elastic.planning.online.price import Prices, migrate_s
from elastic.planning.online.rebalance import even_out
from elastic.planning.online.targets import shrink_targets
from elastic.planning.plan import Plan
from elastic.planning.shape import ModelShape
from elastic.planning.step_cost import StepCost

# A rebalance between shrinks must shorten its horizon's priced time by this share (`_rebalance`).
REBALANCE_GAIN = 0.005
# Checks between decisions at the most while few requests finish (see `OnlineRule._due`).
REPLAN_CHECKS = 8
# A rebalance evens out the KV the members will hold over this many checks (two re-planning
# periods), not over the requests' whole remainders: a step waits for the member holding the most
# KV now, and a later imbalance is the next decision's to fix.
REBALANCE_HORIZON_CHECKS = 2 * REPLAN_CHECKS


@dataclass(frozen=True)
class RuleConfig:
    """How the rule decides, fixed for a rollout: the objective it compares options by (a name, not
    the function: the rule is pickled to the ranks), the decode steps between status checks, the
    samples of the remaining lengths per decision and their seed, the latency guard's
    `max_slowdown` (None: no guard), the requests an engine rank can hold (its KV slots; None:
    unbounded), and how the run's KV cache holds a request: a move is checked in the receiver's
    positions, slots or pages, and a migrated request holds its own copy of its prompt's pages."""

    objective: str = "occupied"
    check_every: int = 16
    samples: int = 16
    seed: int = 0
    max_slowdown: float | None = 0.01
    max_batch: int | None = None
    kv: KVUnit = TOKENS

    def __post_init__(self):
        objective_key(self.objective)  # a ValueError (PlanError) naming the objectives


class OnlineRule:
    """The shared rule; one instance per rollout, built identically on every rank."""

    def __init__(self, plan: Plan, prompt_len: Sequence[int], model: OnlineModel, cost: StepCost,
                 shape: ModelShape, config: RuleConfig = RuleConfig()):
        self.plan, self.model, self.cost, self.shape, self.config = plan, model, cost, shape, config
        self.prices = Prices(plan, prompt_len, cost, shape)
        self.prompt, self.sizes = self.prices.prompt, self.prices.sizes
        self.budget = []  # KV positions each rank may hold in each stage
        for st in plan.stages:
            held = held_counts(st.owners, st.members)
            self.budget.append({r: shape.kv_budget_bytes(h) // shape.kv_bytes_per_token for r, h in held.items()})
        # Position of each rank in the leaving order (0 stays longest): the last stage it is in.
        self.stays = {r: -max(j for j, st in enumerate(plan.stages) if r in st.members) for r in range(plan.ranks)}
        self.guard = LatencyGuard(self.prompt, plan.ranks, cost, config.max_slowdown)
        self.decisions = 0
        self.last = (-(10**9), 10**9)  # (step, live requests) of the last decision

    def key(self, scored: tuple[Estimate]):
        return objective_key(self.config.objective)(scored)

    def _due(self, step: int, live: int) -> bool:
        """Whether to re-plan at this check: once a 64th of the live requests has finished since
        the last decision, or `REPLAN_CHECKS` checks have passed (the samples change little between;
        a 16,384-response batch would otherwise re-plan at every check of a long tail)."""
        last_step, last_live = self.last
        if last_live - live >= max(1, last_live // 64) or step - last_step >= REPLAN_CHECKS * self.config.check_every:
            self.last = (step, live)
            return True
        return False

    # ---- the rule -------------------------------------------------------------------------------
    def decide(self, stage: int, step: int, rank_of: np.ndarray, tokens: np.ndarray,
               done: np.ndarray) -> Decision:
        """The stage to be in after the check at decode step `step`, and the moves it needs.

        `rank_of[i]`: the rank holding response i now; `tokens[i]`: tokens generated so far (the
        length once `done[i]`)."""
        config, migrate = self.config, self.model.options.migrate
        live = np.nonzero(~np.asarray(done, bool))[0]
        rank_of, tokens = np.asarray(rank_of), np.asarray(tokens, float)
        self.guard.tick(self.sizes[stage], step, live, rank_of, tokens)
        if not len(live) or not self._due(step, len(live)):
            return Decision(stage)
        self.decisions += 1
        members = set(self.plan.stages[stage].members)
        targets = []
        for j in range(stage + 1, len(self.plan.stages)):
            leaving = members - set(self.plan.stages[j].members)
            if migrate or not np.isin(rank_of[live], list(leaving)).any():
                targets.append(j)
        if not targets and not migrate:
            return Decision(stage)
        rng = np.random.default_rng([config.seed, step])
        rem = self.model.sample_remaining(live, tokens, done, config.samples, rng)  # (S, n)
        now = LiveState(live, rank_of, tokens, rem)
        longest = self.model.cap or float((tokens[live] + rem.max(axis=0)).max())
        # A request's KV positions in the run's cache; under `slots`, a slot holds the longest
        # prompt plus the longest response.
        held = partial(config.kv.held, slot_len=float(slot_len(self.prompt, longest)))
        grid = Grid(rem, self.prompt[live] + tokens[live], rank_of[live], self.plan.ranks, config.check_every)
        bound = self.guard.bound if config.max_slowdown is not None else None
        candidates = shrink_targets(self.prices, stage, targets, grid, self.key, bound) if targets else []
        if not candidates:
            return self._rebalance(stage, grid, now, held) if migrate else Decision(stage)
        # `shrink_targets` dealt the leaving ranks' requests without KV checks; placed within the
        # budgets (the leaving ranks' requests moved, or, with migration, every live request
        # re-placed, whichever the samples price lower), a shrink must still beat staying as the
        # group is now.
        stay = self.prices.exact(stage, stage, grid, live, rank_of, [], tokens)
        limit = bound(stay.rollout_s) if bound is not None else math.inf
        for j in candidates:
            proposals = []
            for rebalance in (False, True) if migrate else (False,):
                moves = place(self.plan, j, now, self.budget[j], self.prompt, config.max_batch, held, rebalance)
                if moves is not None:
                    proposals.append((self.prices.exact(stage, j, grid, live, rank_of, moves, tokens), moves))
            if not proposals:  # the KV of the leaving ranks' requests fits no member
                continue
            est, moves = min(proposals, key=lambda p: self.key((p[0],)))
            if self.key((est,)) < self.key((stay,)) and est.rollout_s <= limit:
                return self._decision(stage, j, moves, now)
        return Decision(stage)

    def _rebalance(self, stage: int, grid: Grid, now: LiveState, held) -> Decision:
        """Staying: even out the KV the members are expected to hold over the next
        `REBALANCE_HORIZON_CHECKS` checks (`rebalance.even_out`; for `occupied`, toward ranks that
        stay at least as long), taken only if it shortens those checks, priced, by
        `REBALANCE_GAIN` net of the moves. Priced over the whole remainder, the near gain drowns in
        the far samples' noise; the samples are fresh at every decision, so a smaller gain would
        move requests back and forth within their noise."""
        horizon = REBALANCE_HORIZON_CHECKS * self.config.check_every
        stays = None if self.config.objective == "rollout" else self.stays
        moves = even_out(self.plan.stages[stage].members, now, self.prompt, held, horizon, self.budget[stage],
                         self.config.max_batch, stays)
        if not moves:
            return Decision(stage)
        live, rank_of, tokens = now.live, now.rank_of, now.tokens
        keep = self.prices.exact(stage, stage, grid, live, rank_of, [], tokens, horizon)
        even = self.prices.exact(stage, stage, grid, live, rank_of, moves, tokens, horizon)
        if self.key((even,)) < self.key((keep,)) and even.rollout_s <= keep.rollout_s * (1 - REBALANCE_GAIN):
            return self._decision(stage, stage, moves, now)
        return Decision(stage)

    def _decision(self, stage: int, j: int, moves: list[tuple[int, int]], now: LiveState) -> Decision:
        """Stage j with `moves` made, the KV they carry; with the latency guard, its own clock
        charged what they cost (the shrink, if any, and the KV moved)."""
        kv = int(sum(self.prompt[i] + now.tokens[i] for i, _ in moves)) * self.shape.kv_bytes_per_token
        if self.config.max_slowdown is not None:
            spent = migrate_s(self.cost, self.prices.busiest_bytes(moves, now.rank_of, now.tokens), self.sizes[stage])
            if j != stage:
                spent = self.cost.shrink_s(self.prices.moved(stage, j), self.sizes[stage]) + spent
            self.guard.spend(spent)
        return Decision(j, tuple(moves), kv)
