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
(`OnlineRule._rebalance`), since a step waits for the member holding the most.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from elastic.planning.chains.estimate import Estimate
from elastic.planning.chains.schedule import held_counts
from elastic.planning.chains.search import objective_key
from elastic.planning.lengths.remaining import OnlineModel
from elastic.planning.memory.kv_unit import TOKENS, KVUnit, slot_len
from elastic.planning.online.grid import Grid, batch_context
from elastic.planning.online.latency_guard import LatencyGuard
from elastic.planning.online.place import Decision, deal, place
from elastic.planning.online.price import Prices, migrate_s
from elastic.planning.plan import Plan
from elastic.planning.shape import ModelShape
from elastic.planning.step_cost import StepCost

# A rebalance between shrinks must shorten its horizon's priced time by this share (`_rebalance`).
REBALANCE_GAIN = 0.005
# Shrink targets priced exactly per decision, best first by `_price`'s even-spread estimate (a
# large shrink can look best spread evenly and lose once its requests have places).
SHRINK_CANDIDATES = 3
# Checks between decisions at the most while few requests finish (see `OnlineRule._due`).
REPLAN_CHECKS = 8
# A rebalance evens out the KV the members will hold over this many checks (two re-planning
# periods), not over the requests' whole remainders: a step waits for the member holding the most
# KV now, and a later imbalance is the next decision's to fix.
REBALANCE_HORIZON_CHECKS = 2 * REPLAN_CHECKS


class OnlineRule:
    """The shared rule; one instance per rollout, built identically on every rank."""

    def __init__(self, plan: Plan, prompt_len: Sequence[int], model: OnlineModel, cost: StepCost,
                 shape: ModelShape, *, objective: str = "occupied", check_every: int = 16,
                 samples: int = 16, seed: int = 0, max_slowdown: float | None = 0.01,
                 max_batch: int | None = None, kv: KVUnit = TOKENS):
        objective_key(objective)  # a ValueError (PlanError) naming the objectives
        self.plan, self.model, self.cost, self.shape = plan, model, cost, shape
        self.prices = Prices(plan, prompt_len, cost, shape)
        self.prompt, self.sizes = self.prices.prompt, self.prices.sizes
        self.objective = objective  # a name, not the function: the rule is pickled to the ranks
        self.k, self.samples, self.seed = check_every, samples, seed
        self.max_slowdown = max_slowdown
        self.max_batch = max_batch  # requests an engine rank can hold (its KV slots), if bounded
        # How the run's KV cache holds a request: a move is checked in the receiver's positions,
        # slots or pages (`held`); a migrated request holds its own copy of its prompt's pages.
        self.kv = kv
        self.slot_len = 0.0  # under `slots`: the longest prompt plus the longest response (`decide`)
        self.budget = []  # KV positions each rank may hold in each stage
        for st in plan.stages:
            held = held_counts(st.owners, st.members)
            self.budget.append({r: shape.kv_budget_bytes(h) // shape.kv_bytes_per_token for r, h in held.items()})
        # Position of each rank in the leaving order (0 stays longest): the last stage it is in.
        self.stays = {r: -max(j for j, st in enumerate(plan.stages) if r in st.members) for r in range(plan.ranks)}
        self.guard = LatencyGuard(self.prompt, plan.ranks, cost, max_slowdown)
        self.decisions = 0
        self.last = (-(10**9), 10**9)  # (step, live requests) of the last decision

    @property
    def clock(self) -> dict[str, float]:
        """The guard's two priced clocks, this rollout's ("own") and vanilla's (`LatencyGuard`)."""
        return self.guard.clock

    @clock.setter
    def clock(self, clocks: dict[str, float]) -> None:
        self.guard.clock = clocks

    def _bound(self, fastest_s: float) -> float:
        return self.guard.bound(fastest_s)

    def _deal(self, j: int, ranks: np.ndarray, rem: np.ndarray) -> np.ndarray:
        return deal(self.plan, j, ranks, rem)

    def held(self, positions, more):
        """KV positions a request holding `positions` holds once `more` are added, in the run's cache."""
        return self.kv.held(positions, more, self.slot_len)

    def key(self, scored: tuple[Estimate]):
        return objective_key(self.objective)(scored)

    def _due(self, step: int, live: int) -> bool:
        """Whether to re-plan at this check: once a 64th of the live requests has finished since
        the last decision, or `REPLAN_CHECKS` checks have passed (the samples change little between;
        a 16,384-response batch would otherwise re-plan at every check of a long tail)."""
        last_step, last_live = self.last
        if last_live - live >= max(1, last_live // 64) or step - last_step >= REPLAN_CHECKS * self.k:
            self.last = (step, live)
            return True
        return False

    # ---- the rule -------------------------------------------------------------------------------
    def decide(self, stage: int, step: int, rank_of: np.ndarray, tokens: np.ndarray,
               done: np.ndarray) -> Decision:
        """The stage to be in after the check at decode step `step`, and the moves it needs.

        `rank_of[i]`: the rank holding response i now; `tokens[i]`: tokens generated so far (the
        length once `done[i]`)."""
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
            if self.model.options.migrate or not np.isin(rank_of[live], list(leaving)).any():
                targets.append(j)
        if not targets and not self.model.options.migrate:
            return Decision(stage)
        rng = np.random.default_rng([self.seed, step])
        rem = self.model.sample_remaining(live, tokens, done, self.samples, rng)  # (S, n)
        longest = self.model.cap or float((tokens[live] + rem.max(axis=0)).max())
        self.slot_len = float(slot_len(self.prompt, longest))
        grid = Grid(rem, self.prompt[live] + tokens[live], rank_of[live], self.plan.ranks, self.k)
        candidates = self._price(stage, targets, grid) if targets else []
        if not candidates:
            return self._rebalance(stage, grid, live, rank_of, tokens, rem) \
                if self.model.options.migrate else Decision(stage)
        # `_price` dealt the leaving ranks' requests without KV checks; placed within the budgets
        # (the leaving ranks' requests moved, or, with migration, every live request re-placed,
        # whichever the samples price lower), a shrink must still beat staying as the group is now.
        stay = self.prices.exact(stage, stage, grid, live, rank_of, [], tokens)
        bound = self._bound(stay.rollout_s) if self.max_slowdown is not None else math.inf
        for j in candidates:
            proposals = []
            for rebalance in (False, True) if self.model.options.migrate else (False,):
                moves = place(self.plan, self.budget[j], self.prompt, self.max_batch, j, live, rank_of, tokens, rem,
                              self.held, rebalance)
                if moves is not None:
                    proposals.append((self.prices.exact(stage, j, grid, live, rank_of, moves, tokens), moves))
            if not proposals:  # the KV of the leaving ranks' requests fits no member
                continue
            est, moves = min(proposals, key=lambda p: self.key((p[0],)))
            if self.key((est,)) < self.key((stay,)) and est.rollout_s <= bound:
                kv = int(sum(self.prompt[i] + tokens[i] for i, _ in moves)) * self.shape.kv_bytes_per_token
                if self.max_slowdown is not None:
                    self.clock["own"] += self.cost.shrink_s(self.prices.moved(stage, j), self.sizes[stage]) \
                        + migrate_s(self.cost, self.prices.busiest_bytes(moves, rank_of, tokens), self.sizes[stage])
                return Decision(j, tuple(moves), kv)
        return Decision(stage)

    def _price(self, stage: int, targets: list[int], grid: Grid) -> list[int]:
        """The targets to shrink to now, best first, or none when staying (perhaps to shrink later)
        is best. The leaving ranks' requests are dealt to the members that stay (`online.place.deal`) and every
        option is priced per sample at its busiest member: spread evenly instead, a large shrink
        looked faster than it ran (the busiest of 64 members holding 250 requests each is some 15%
        above their mean)."""
        S = grid.seg.shape[0]
        W, g0 = self.plan.ranks, self.sizes[stage]
        seg, bounds, delays, rem, ranks, held = grid.seg, grid.bounds, grid.delays, grid.rem, grid.ranks, grid.held

        def busiest(j: int) -> tuple[np.ndarray, np.ndarray]:
            kept = list(self.plan.stages[j].members)
            count, kv = grid.per_rank(self._deal(j, ranks, rem) if j != stage else ranks)
            return batch_context(count[:, :, kept].max(axis=2), kv[:, :, kept].max(axis=2))

        tau_now = self.prices.steps(*busiest(stage), g0)
        run_now = seg * tau_now[None, :]
        before = np.concatenate([np.zeros((S, 1)), np.cumsum(run_now, axis=1)], axis=1)  # time to bound k
        kv_token = float(self.shape.kv_bytes_per_token)
        stay = before[:, -1] + self.prices.restore_s[stage]
        options = [(self.prices.estimate(stay, np.zeros(S), g0, g0, W)[0], stage, 0)]
        staying = self.key((options[0][0],))
        d = np.array([0] + delays, float)
        at = np.searchsorted(bounds, d)
        for j in targets:
            g = self.sizes[j]
            after = seg * self.prices.steps(*busiest(j), g)[None, :]
            tail = np.concatenate([np.cumsum(after[:, ::-1], axis=1)[:, ::-1], np.zeros((S, 1))], axis=1)
            moving = ~np.isin(ranks, self.plan.stages[j].members)
            # The requests still live at the shrink move, their KV grown by d tokens: each leaving
            # rank sends its own, the members receive them spread evenly: `busiest_load`'s tally in
            # expectation, one column per delay.
            per = (rem[:, moving, None] > d).mean(axis=0) * (held[moving][:, None] + d)  # (moving, delays)
            _, sender = np.unique(ranks[moving], return_inverse=True)
            sent = np.zeros((sender.max() + 1 if len(sender) else 1, len(d)))
            np.add.at(sent, sender, per)
            moved = kv_token * np.maximum(sent.max(axis=0), per.sum(axis=0) / g)
            shrink = self.cost.shrink_s(self.prices.moved(stage, j), g0) \
                + np.array([migrate_s(self.cost, b, g0) for b in moved])
            until = before[:, at] + shrink[None, :]
            whole = until + tail[:, at] + self.prices.restore_s[j]
            for est, delay in zip(self.prices.estimate(whole, until, g0, g, W), d):
                options.append((est, j, delay))
        # Whatever the objective, no option predicted to take longer than `LatencyGuard.bound` allows: in a
        # synchronous job a slower rollout holds every rank back (`max_slowdown` None: no guard,
        # the objective alone decides, as in `make_plan`).
        if self.max_slowdown is not None:
            bound = self._bound(min(o[0].rollout_s for o in options))
            options = [o for o in options if o[0].rollout_s <= bound]
        ranked = sorted(options, key=lambda o: (self.key((o[0],)), o[2]))
        if ranked[0][1] == stage or ranked[0][2] != 0:  # staying, or shrinking later, is best
            return []
        now = [j for est, j, delay in ranked if delay == 0 and j != stage and self.key((est,)) < staying]
        return list(dict.fromkeys(now))[:SHRINK_CANDIDATES]

    def _rebalance(self, stage: int, grid: Grid, live, rank_of, tokens, rem) -> Decision:
        """Staying: even out the KV the members are expected to hold over the next
        `REBALANCE_HORIZON_CHECKS` checks, with the fewest moves, to whichever member holds least
        (for `occupied`, among those that stay at least as long), taken only if it shortens those
        checks, priced, by `REBALANCE_GAIN` net of the moves. Priced over the whole remainder, the
        near gain drowns in the far samples' noise; the samples are fresh at every decision, so a
        smaller gain would move requests back and forth within their noise; a balanced group
        proposes no move at all."""
        kept = list(self.plan.stages[stage].members)
        held = self.prompt[live] + tokens[live]
        soon = np.minimum(rem, REBALANCE_HORIZON_CHECKS * self.k)
        work = (soon * (held[None, :] + soon / 2)).mean(axis=0)
        need = self.held(held, rem.max(axis=0))
        on = {r: [] for r in kept}  # each member's movable requests (columns), ascending
        load, kv, count = dict.fromkeys(kept, 0.0), dict.fromkeys(kept, 0.0), dict.fromkeys(kept, 0)
        for col, r in enumerate(rank_of[live].tolist()):
            on[r].append(col)
            load[r] += work[col]
            kv[r] += need[col]
            count[r] += 1
        moves = []
        for _ in range(len(kept)):
            hi = max(kept, key=lambda r: (load[r], -r))
            # For capacity, work moves only toward ranks that stay at least as long (the leaving
            # order), so a rebalance never loads a rank the next shrink would have to empty.
            lo = min((r for r in kept if self.objective == "rollout" or self.stays[r] <= self.stays[hi]),
                     key=lambda r: (load[r], r))
            gap = load[hi] - load[lo]
            cand = np.array(on[hi], dtype=np.int64)
            fits = cand[(work[cand] < gap) & (kv[lo] + need[cand] <= self.budget[stage][lo])]
            if not len(fits) or count[lo] >= (self.max_batch or len(live)):
                break
            col = int(fits[np.argmin(np.abs(gap / 2 - work[fits]))])  # ties: the first column
            on[hi].remove(col)  # a moved request stays put for the rest of this rebalance
            for r, sign in ((hi, -1), (lo, 1)):
                load[r] += sign * work[col]
                kv[r] += sign * need[col]
                count[r] += sign
            moves.append((int(live[col]), lo))
        if not moves:
            return Decision(stage)
        horizon = REBALANCE_HORIZON_CHECKS * self.k
        keep = self.prices.exact(stage, stage, grid, live, rank_of, [], tokens, horizon)
        even = self.prices.exact(stage, stage, grid, live, rank_of, moves, tokens, horizon)
        if self.key((even,)) < self.key((keep,)) and even.rollout_s <= keep.rollout_s * (1 - REBALANCE_GAIN):
            kv_bytes = int(sum(self.prompt[i] + tokens[i] for i, _ in moves)) * self.shape.kv_bytes_per_token
            if self.max_slowdown is not None:
                self.clock["own"] += migrate_s(self.cost, self.prices.busiest_bytes(moves, rank_of, tokens),
                                               self.sizes[stage])
            return Decision(stage, tuple(moves), kv_bytes)
        return Decision(stage)
