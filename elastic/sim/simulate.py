"""Cluster simulator: carry out a `Plan` on a cost model instead of GPUs, one decode step at a time.

Semantics (docs/design.md), the same the runtime follows, so that a simulated ledger predicts a real one:
- Tick 0 is the prefill of every rank's batch (it emits each response's first token); then one
  tick per synchronous decode step of the active EP group, so a response of L tokens is live for
  L - 1 decode steps. A step lasts `step_overhead + max over members(own compute) + all-to-all(group)`.
  A member with a live request accrues `busy`, one without accrues `dummy`.
- Every `check_every` steps the ranks compare drain status (the runtime's status all-reduce) and the
  stage is `Plan.advance(current, drained)`: a leaving rank that outlives its prediction holds its
  stage, it is never cut. A shrink is one tick of `transition` for the old group, priced by
  `CostModel.transfer_s(Plan.transfers(...))`; the leaving ranks are then detached and accrue
  `idle`, or `leased` once a lease has started (`lease_start_s` after detaching) when leases are on.
- After the last token, full-world restoration (experts back to stage 0's owners, then the weight
  check: `CostModel.restore_extra_s`) is one `transition` tick for all W ranks.
- Optional KV migration (`migrate_max > 0`): when the ranks a stage waits for hold at most that many
  live responses in all (stragglers), those move with their KV to resident ranks that have room (KV
  and, with `max_batch`, a free slot), and the stage starts.
- With an online rule (`adaptive`), the rule replaces `Plan.advance` at every check, reading only
  what the runtime's status gives it (tokens so far, finished or not), and its moves are booked
  like migrations (a rebalance inside the group is one `transition` tick of its members).

A request's progress is counted in steps, so which rank is live at step t does not depend on step
durations; the simulator uses that to price whole stretches between checks with numpy at once. The
ledger is kept in ticks as well as seconds, so `Ledger.check` is exact.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from elastic.ledger import Ledger
from elastic.planning.busiest import busiest_load
from elastic.planning.memory.kv_unit import KV_KINDS, KVUnit, kv_unit, share_groups, slot_len
from elastic.planning.online.rule import OnlineRule
from elastic.planning.plan import Plan
from elastic.planning.shape import ModelShape
from elastic.sim.admission import peak_concurrent, start_steps
from elastic.sim.books import RankBooks
from elastic.sim.costmodel import CostModel
from elastic.sim.placement import Placement
from elastic.trace import TraceRecord


@dataclass(frozen=True)
class SimConfig:
    # Steps between drain-status checks (the runtime's status all-reduce interval).
    check_every: int = 16
    # Detached ranks run side work under leases; a lease starts this long after detaching (job
    # placement and warm-up; assumption) and is pre-empted by the restoration.
    lease: bool = False
    lease_start_s: float = 1.0
    # When the ranks a stage waits for hold at most this many live responses in all, move those with
    # their KV to residents and start the stage (0: never migrate).
    migrate_max: int = 0
    # Record each rank's timeline (elastic/timeline.py) in its ledger, as the runtime does.
    timeline: bool = False
    # How a rank admits its requests into its KV budget (elastic/sim/admission.py): `tokens`, all
    # at the prefill; `slots` or `paged` (pages of kv_page_size positions), as KV room frees.
    kv: str = "tokens"
    kv_page_size: int = 16
    # Requests one rank decodes at once (the engine's `max_batch_per_rank`, its KV slots): the rest
    # wait, first come first served, under any `kv` (None: no cap).
    max_batch: int | None = None

    def __post_init__(self):
        if self.check_every < 1:
            raise ValueError(f"check_every: expected >= 1, got {self.check_every}")
        if self.lease_start_s < 0:
            raise ValueError(f"lease_start_s: expected >= 0, got {self.lease_start_s}")
        if self.migrate_max < 0:
            raise ValueError(f"migrate_max: expected >= 0, got {self.migrate_max}")
        if self.kv not in KV_KINDS:
            raise ValueError(f"kv: expected one of {', '.join(KV_KINDS)}, got {self.kv!r}")
        if self.kv_page_size < 1:
            raise ValueError(f"kv_page_size: expected >= 1, got {self.kv_page_size}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch: expected >= 1 or None (no cap), got {self.max_batch}")

    @property
    def unit(self) -> KVUnit:
        """How a request holds KV positions: what admission, the plan and every move are checked in."""
        return kv_unit(self.kv, self.kv_page_size)

    @property
    def admits(self) -> bool:
        """Whether requests start as room frees (elastic/sim/admission.py): a cache that queues, or a
        cap; else every request starts at the prefill."""
        return self.unit.queues or self.max_batch is not None


@dataclass
class SimulatedRollout:
    ledger: Ledger
    response_tokens: int
    lower_bound_s: float
    # (time_s, active ranks) at the start and after every change of the active group.
    timeline: list[tuple[float, int]] = field(default_factory=list)
    # (decode step, from stage, to stage, seconds) of every shrink, then the restore.
    transitions: list[tuple[int, int, int, float]] = field(default_factory=list)
    migrated: int = 0
    migrated_kv_bytes: int = 0
    rebalances: int = 0  # moves between members that stay (online rule only)
    # Each rank's most requests decoding at once where admission ran (`SimConfig.admits`, else None).
    peak_concurrent: list[int] | None = None
    max_batch: int | None = None  # the cap admission ran under (`SimConfig.max_batch`)


def lower_bound_s(prompt_lens, response_lens, cost: CostModel, floor: int, ranks: int) -> float:
    """No policy can finish sooner: the longest response alone, prefilled and decoded at the cheapest
    step any group of `floor..ranks` members allows (`CostModel.min_decode_step_s`)."""
    prompt_lens, response_lens = np.asarray(prompt_lens), np.asarray(response_lens)
    longest = int(response_lens.max())
    prompt = float(prompt_lens[response_lens == longest].min())
    sizes = np.arange(max(1, min(floor, ranks)), ranks + 1)
    prefill = cost.step_overhead_s + float(cost.rank_compute_s(prompt, prompt, 0.0, 0.0)) \
        + float(np.min(cost.a2a_s(sizes, prompt)))
    decode = max(longest - 1, 0)  # the prefill emits the first token
    ctx = prompt + np.arange(1, decode + 1, dtype=np.float64)
    steps = cost.min_decode_step_s(ctx, 1) - float(cost.a2a_s(1, 1.0))
    return prefill + float(np.sum(steps)) + decode * float(np.min(cost.a2a_s(sizes, 1.0)))


class _Rollout:
    """One simulated rollout; `run` drives it from prefill to restoration, deciding what happens,
    while `at` (`Placement`) holds where the responses are and `books` (`RankBooks`) what the ranks did."""

    def __init__(self, plan: Plan, batch: Sequence[TraceRecord], cost: CostModel, shape: ModelShape,
                 config: SimConfig, known_prefix: Mapping[tuple[str, int], int] | None = None):
        if plan.num_experts != cost.shape.num_experts:
            raise ValueError(f"plan has {plan.num_experts} experts, cost model {cost.name!r} has "
                             f"{cost.shape.num_experts}")
        rank_of = plan.rank_of()
        missing = [r.key for r in batch if r.key not in rank_of]
        if missing:
            raise ValueError(f"plan assigns no rank to {len(missing)} responses, e.g. {missing[0]}")
        self.plan, self.cost, self.shape, self.cfg = plan, cost, shape, config
        rank = np.array([rank_of[r.key] for r in batch], dtype=np.int64)
        tokens = np.array([r.response_len for r in batch], dtype=np.int64)
        prompt = np.array([r.prompt_len for r in batch], dtype=np.int64)
        # The decode step after which each request starts (None: every one at the prefill).
        start = None if not config.admits else start_steps(
            config.unit, shape, self._owned(0), rank, prompt, tokens, np.maximum(tokens - 1, 0),
            share_groups([r.key for r in batch], known_prefix), config.max_batch)
        self.at = Placement(rank, tokens, prompt, plan.ranks, start)
        self.books = RankBooks(plan.ranks, config.lease, config.lease_start_s, config.timeline)
        self.no_migration: set[int] = set()  # stages whose stragglers had nowhere to go
        self.result = SimulatedRollout(ledger=None, response_tokens=int(self.at.tokens.sum()),  # type: ignore[arg-type]
                                    lower_bound_s=0.0, max_batch=config.max_batch)
        if start is not None:
            self.result.peak_concurrent = peak_concurrent(self.at.live)

    def _owned(self, stage: int) -> np.ndarray:
        counts = Counter(self.plan.stages[stage].owner_of(e) for e in range(self.plan.num_experts))
        return np.array([counts.get(r, 0) for r in range(self.plan.ranks)], dtype=np.float64)

    # ---- phases -----------------------------------------------------------------------------------
    def _prefill(self) -> None:
        w, cost, at = self.plan.ranks, self.cost, self.at
        tokens = np.bincount(at.rank, weights=at.prompt * (at.start == 0), minlength=w)
        per_rank = cost.rank_compute_s(tokens, tokens, self._owned(0), tokens.sum())
        has = np.bincount(at.rank, minlength=w) > 0
        dt = float(cost.contention(has.sum())) * (cost.step_overhead_s + float(per_rank.max())) \
            + float(cost.a2a_s(w, tokens.max()))
        self.books.prefill(has, dt)

    def _decode(self, stage: int, first: int, last: int) -> None:
        """Price decode steps first..last (inclusive) in `stage` and book them."""
        if last < first:
            return
        cost = self.cost
        members = np.array(self.plan.stages[stage].members, dtype=np.int64)
        steps = np.arange(first, last + 1)
        live = self.at.live[np.ix_(members, steps)]
        kv = self.at.psum[np.ix_(members, steps)] + live * steps[None, :]
        group_tokens = live.sum(axis=0)
        own = self._owned(stage)[members][:, None]
        compute = cost.rank_compute_s(live, kv, own, group_tokens[None, :])
        durations = cost.contention((live > 0).sum(axis=0)) * (cost.step_overhead_s + compute.max(axis=0)) \
            + cost.a2a_s(len(members), live.max(axis=0))
        self.books.decode(members, live > 0, durations)

    def _next_check(self, stage: int, after: int) -> tuple[int, bool]:
        """The first check step > `after` at which the next stage can start, and whether it starts
        by migrating stragglers rather than by its ranks draining on their own."""
        k = self.cfg.check_every
        trigger = list(self.plan.stages[stage + 1].drained)
        ready = max((int(self.at.drain[r]) for r in trigger), default=0)
        when = max(k * math.ceil(ready / k), k * (after // k + 1))
        if self.cfg.migrate_max > 0 and trigger and stage not in self.no_migration:
            few = self.at.few_left_step(trigger, self.cfg.migrate_max)
            alt = max(k * math.ceil(few / k), k * (after // k + 1))
            if alt < when:
                return alt, True
        return when, False

    def _migrate(self, stage: int, step: int) -> float | None:
        """Move the live responses of the ranks stage+1 waits for onto residents; seconds, or None
        if some response has nowhere to go without breaking a KV budget."""
        plan = self.plan
        target = plan.stages[stage + 1]
        residents = [r for r in plan.stages[-1].members if r in target.members]
        owned = self._owned(len(plan.stages) - 1)
        budget = {r: self.shape.kv_budget_bytes(int(owned[r])) // self.shape.kv_bytes_per_token for r in residents}
        unit, slot = self.cfg.unit, int(slot_len(self.at.prompt, np.max(self.at.tokens)))
        placed = self.at.move_stragglers(target.drained, residents, budget, step,
                                         lambda kv_base, t: unit.held(kv_base, t, slot), self.cfg.max_batch)
        return None if placed is None else self._moved(placed, step)

    def _moved(self, moves: list[tuple[int, int]], step: int) -> float:
        """Book moves already made (their KV as it stood at `step`); the seconds they take. Moves
        between distinct pairs run at once, so the busiest rank's sends or receives set the time,
        each over the link between its ranks (as `CostModel.transfer_s` books expert moves)."""
        cost, at, kv_total = self.cost, self.at, 0
        timed = []
        for i, dst in moves:
            kv_bytes = int(at.prompt[i] + max(step - int(at.start[i]), 0)) * self.shape.kv_bytes_per_token
            src = int(at.origin[i])
            timed.append((src, dst, kv_bytes / cost.link_bytes_per_s(src, dst)))
            self.books.mark((src, dst), "migrate", "1 moved")
            kv_total += kv_bytes
            at.origin[i] = dst
        seconds = busiest_load(timed)
        self.result.migrated += len(moves)
        self.result.migrated_kv_bytes += kv_total
        at.redrain()
        return seconds

    def _shrink(self, stage: int, new: int, step: int, extra_s: float) -> None:
        """The transition from `stage` to `new` (its expert moves plus `extra_s` of KV moves)."""
        plan, cost = self.plan, self.cost
        members = np.array(plan.stages[stage].members, dtype=np.int64)
        seconds = extra_s + max(cost.transfer_s(plan.transfers(stage, new)), cost.shrink_fixed_s)
        self.books.transition(members, seconds)
        self.books.mark(members, "stage", f"stage {new}: {len(plan.stages[new].members)} ranks")
        self.result.transitions.append((step, stage, new, seconds))
        self.books.detach(np.setdiff1d(members, plan.stages[new].members))
        self.result.timeline.append((self.books.now, len(plan.stages[new].members)))

    def _run_online(self, rule) -> int:
        """Decode with the online rule deciding at every check; returns the final stage."""
        at, steps_total = self.at, self.at.steps_total
        stage, step, k = 0, 0, self.cfg.check_every
        while step < steps_total:
            end = min(k * (step // k + 1), steps_total)
            self._decode(stage, step + 1, end)
            step = end
            if step >= steps_total:
                break
            done = at.length <= step
            d = rule.decide(stage, step, at.rank, np.clip(step + 1 - at.start, 0, at.tokens), done)
            for i, dst in d.moves:
                at.move(i, dst, step)
            seconds = self._moved(list(d.moves), step)
            if d.stage != stage:
                self._shrink(stage, d.stage, step, seconds)
                stage = d.stage
            elif d.moves:  # a rebalance inside the group: one transition tick for its members
                self.books.transition(np.array(self.plan.stages[stage].members, dtype=np.int64), seconds)
                self.result.rebalances += 1
        return stage

    def run(self, rule=None) -> SimulatedRollout:
        plan, cost, res, steps_total = self.plan, self.cost, self.result, self.at.steps_total
        w = plan.ranks
        res.timeline.append((0.0, w))
        self._prefill()
        stage, step = (self._run_online(rule), steps_total) if rule is not None else (0, 0)
        while step < steps_total:
            if stage + 1 < len(plan.stages):
                check, by_migration = self._next_check(stage, step)
            else:
                check, by_migration = steps_total, False
            end = min(check, steps_total)
            self._decode(stage, step + 1, end)
            step = end
            if step >= steps_total:
                break
            extra = 0.0
            if by_migration:
                moved = self._migrate(stage, step)
                if moved is None:
                    self.no_migration.add(stage)
                    continue
                extra = moved
            drained = {r for r in range(w) if self.at.drain[r] <= step}
            new = plan.advance(stage, drained)
            if new == stage:
                continue
            self._shrink(stage, new, step, extra)
            stage = new
        if stage != 0:
            seconds = max(cost.transfer_s(plan.transfers(stage, 0)), cost.shrink_fixed_s) + cost.restore_extra_s
            self.books.end_leases()
            self.books.transition(np.arange(w), seconds)
            self.books.mark(range(w), "stage", f"stage 0: {w} ranks (restore)")
            res.transitions.append((step, stage, 0, seconds))
            res.timeline.append((self.books.now, w))
        res.ledger = self.books.ledger()
        res.lower_bound_s = lower_bound_s(self.at.prompt, self.at.tokens, cost, plan.floor, w)
        return res


def simulate_rollout(plan: Plan, batch: Sequence[TraceRecord], cost: CostModel,
                     shape: ModelShape | None = None, config: SimConfig | None = None,
                     rule: OnlineRule | None = None,
                     known_prefix: Mapping[tuple[str, int], int] | None = None) -> SimulatedRollout:
    """Carry out `plan` on `batch` (one rollout) and return its ledger; `Ledger.check` has passed.
    With `rule` (built on the same batch order), the online rule chooses the stages instead of
    `Plan.advance`, at every check, and moves requests as it says. `known_prefix`: the tokens so far
    of responses carried over from an earlier rollout (re-prefilled with them, they share no
    prompt pages under `paged`)."""
    if not batch:
        raise ValueError("simulate_rollout: the batch is empty")
    return _Rollout(plan, batch, cost, shape or ModelShape(), config or SimConfig(), known_prefix).run(rule)
