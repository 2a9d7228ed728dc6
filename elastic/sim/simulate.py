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
  live responses in all (stragglers), those move with their KV to resident ranks that have room, and
  the stage starts.
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
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from elastic.ledger import STATES, Ledger, RankLedger
from elastic.planning.busiest import busiest_load
from elastic.planning.plan import Plan
from elastic.planning.replan import OnlineRule
from elastic.planning.shape import ModelShape
from elastic.sim.admission import KV_ADMISSIONS, peak_concurrent, start_steps
from elastic.sim.costmodel import CostModel
from elastic.timeline import RankTimeline
from elastic.trace import TraceRecord

_BUSY, _DUMMY, _TRANS, _LEASED, _IDLE = (STATES.index(s) for s in ("busy", "dummy", "transition", "leased", "idle"))


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

    def __post_init__(self):
        if self.check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {self.check_every}")
        if self.lease_start_s < 0:
            raise ValueError(f"lease_start_s must be >= 0, got {self.lease_start_s}")
        if self.migrate_max < 0:
            raise ValueError(f"migrate_max must be >= 0, got {self.migrate_max}")
        if self.kv not in KV_ADMISSIONS or self.kv_page_size < 1:
            raise ValueError(f"kv: expected one of {', '.join(KV_ADMISSIONS)} and kv_page_size >= 1, "
                             f"got {self.kv!r}, {self.kv_page_size}")


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
    # Each rank's most requests decoding at once, under a `slots` or `paged` admission (else None).
    peak_concurrent: list[int] | None = None


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
    """The state of one simulated rollout; `run` drives it from prefill to restoration."""

    def __init__(self, plan: Plan, batch: Sequence[TraceRecord], cost: CostModel, shape: ModelShape,
                 config: SimConfig):
        if plan.num_experts != cost.shape.num_experts:
            raise ValueError(f"plan has {plan.num_experts} experts, cost model {cost.name!r} has "
                             f"{cost.shape.num_experts}")
        rank_of = plan.rank_of()
        missing = [r.key for r in batch if r.key not in rank_of]
        if missing:
            raise ValueError(f"plan assigns no rank to {len(missing)} responses, e.g. {missing[0]}")
        self.plan, self.cost, self.shape, self.cfg = plan, cost, shape, config
        w = plan.ranks
        self.rank = np.array([rank_of[r.key] for r in batch], dtype=np.int64)
        self.tokens = np.array([r.response_len for r in batch], dtype=np.int64)
        # Decode steps per response: the prefill emits the first token, as real engines do.
        self.length = np.maximum(self.tokens - 1, 0)
        self.prompt = np.array([r.prompt_len for r in batch], dtype=np.int64)
        # The decode step after which each request starts, and its KV then: prompt + (t - start).
        self.start = np.zeros(len(batch), dtype=np.int64) if config.kv == "tokens" else start_steps(
            config.kv, config.kv_page_size, shape, self._owned(0), self.rank, self.prompt, self.tokens, self.length)
        self.length += self.start
        self.kv_base = self.prompt - self.start
        self.steps_total = int(self.length.max()) if len(batch) else 0
        cols = self.steps_total + 2
        # live[r, t]: requests of rank r still decoding at decode step t (decode length >= t), whose
        # KV then holds prompt + t tokens; psum: their prompts.
        ends = np.zeros((w, cols), dtype=np.int64)
        pends = np.zeros((w, cols), dtype=np.int64)
        np.add.at(ends, (self.rank, self.length), 1)
        np.add.at(pends, (self.rank, self.length), self.kv_base)
        if config.kv != "tokens":  # not yet admitted at step t: start >= t
            np.add.at(ends, (self.rank, self.start), -1)
            np.add.at(pends, (self.rank, self.start), -self.kv_base)
        self.live = np.cumsum(ends[:, ::-1], axis=1)[:, ::-1].copy()
        self.psum = np.cumsum(pends[:, ::-1], axis=1)[:, ::-1].copy()
        self.drain = np.zeros(w, dtype=np.int64)
        np.maximum.at(self.drain, self.rank, self.length)
        self.sec = np.zeros((w, len(STATES)))
        self.ticks = np.zeros((w, len(STATES)), dtype=np.int64)
        self.now = 0.0
        self.detached_at = np.full(w, np.inf)
        self.origin = self.rank.copy()  # where each response's KV was before its latest move
        self.no_migration: set[int] = set()  # stages whose stragglers had nowhere to go
        self.result = SimulatedRollout(ledger=None, response_tokens=int(self.tokens.sum()),  # type: ignore[arg-type]
                                    lower_bound_s=0.0)
        self.timelines = [RankTimeline() for _ in range(w)] if config.timeline else None
        if config.kv != "tokens":
            self.result.peak_concurrent = peak_concurrent(self.live)

    # ---- ledger helpers ---------------------------------------------------------------------------
    def _account_detached(self, members: np.ndarray, starts: np.ndarray, durations: np.ndarray) -> None:
        """Ticks starting at `starts` (absolute seconds): every rank outside `members` is detached."""
        out = np.setdiff1d(np.arange(self.plan.ranks), members)
        total_s, total_n = float(durations.sum()), len(durations)
        for when in np.unique(self.detached_at[out]):
            group = out[self.detached_at[out] == when]
            if self.cfg.lease:
                first = int(np.searchsorted(starts, when + self.cfg.lease_start_s, side="left"))
                leased_s, leased_n = float(durations[first:].sum()), total_n - first
            else:
                leased_s, leased_n = 0.0, 0
            self.sec[group, _LEASED] += leased_s
            self.ticks[group, _LEASED] += leased_n
            self.sec[group, _IDLE] += total_s - leased_s
            self.ticks[group, _IDLE] += total_n - leased_n
            for r in group if self.timelines is not None else ():
                tl = self.timelines[r]
                tl.add("idle", total_s - leased_s, total_n - leased_n)
                if leased_n and tl.states[-1] != "leased":
                    tl.mark("lease-start", "side work")
                tl.add("leased", leased_s, leased_n)

    def _transition(self, members: np.ndarray, seconds: float) -> None:
        self._account_detached(members, np.array([self.now]), np.array([seconds]))
        self.sec[members, _TRANS] += seconds
        self.ticks[members, _TRANS] += 1
        for r in members if self.timelines is not None else ():
            self.timelines[r].add("transition", seconds)
        self.now += seconds

    def _owned(self, stage: int) -> np.ndarray:
        counts = Counter(self.plan.stages[stage].owner_of(e) for e in range(self.plan.num_experts))
        return np.array([counts.get(r, 0) for r in range(self.plan.ranks)], dtype=np.float64)

    # ---- phases -----------------------------------------------------------------------------------
    def _prefill(self) -> None:
        w, cost = self.plan.ranks, self.cost
        members = np.arange(w)
        tokens = np.bincount(self.rank, weights=self.prompt * (self.start == 0), minlength=w)
        per_rank = cost.rank_compute_s(tokens, tokens, self._owned(0), tokens.sum())
        has = np.bincount(self.rank, minlength=w) > 0
        dt = float(cost.contention(has.sum())) * (cost.step_overhead_s + float(per_rank.max())) \
            + float(cost.a2a_s(w, tokens.max()))
        self.sec[members, np.where(has, _BUSY, _DUMMY)] += dt
        self.ticks[members, np.where(has, _BUSY, _DUMMY)] += 1
        for r in members if self.timelines is not None else ():
            self.timelines[r].add("busy" if has[r] else "dummy", dt)
        self.now += dt

    def _decode(self, stage: int, first: int, last: int) -> None:
        """Price decode steps first..last (inclusive) in `stage` and book them."""
        if last < first:
            return
        cost = self.cost
        members = np.array(self.plan.stages[stage].members, dtype=np.int64)
        steps = np.arange(first, last + 1)
        live = self.live[np.ix_(members, steps)]
        kv = self.psum[np.ix_(members, steps)] + live * steps[None, :]
        group_tokens = live.sum(axis=0)
        own = self._owned(stage)[members][:, None]
        compute = cost.rank_compute_s(live, kv, own, group_tokens[None, :])
        durations = cost.contention((live > 0).sum(axis=0)) * (cost.step_overhead_s + compute.max(axis=0)) \
            + cost.a2a_s(len(members), live.max(axis=0))
        starts = self.now + np.concatenate(([0.0], np.cumsum(durations)[:-1]))
        busy = live > 0
        self.sec[members, _BUSY] += (busy * durations[None, :]).sum(axis=1)
        self.sec[members, _DUMMY] += (~busy * durations[None, :]).sum(axis=1)
        self.ticks[members, _BUSY] += busy.sum(axis=1)
        self.ticks[members, _DUMMY] += (~busy).sum(axis=1)
        if self.timelines is not None:
            self._record_decode(members, busy, durations)
        self._account_detached(members, starts, durations)
        self.now += float(durations.sum())

    def _record_decode(self, members: np.ndarray, busy: np.ndarray, durations: np.ndarray) -> None:
        """Each member's busy and dummy runs of these steps, on its timeline."""
        clock = np.concatenate(([0.0], np.cumsum(durations)))
        for r, row in zip(members, busy):
            bounds = np.concatenate(([0], np.flatnonzero(row[1:] != row[:-1]) + 1, [len(row)]))
            for a, z in zip(bounds[:-1], bounds[1:]):
                self.timelines[r].add("busy" if row[a] else "dummy", float(clock[z] - clock[a]), int(z - a))

    def _next_check(self, stage: int, after: int) -> tuple[int, bool]:
        """The first check step > `after` at which the next stage can start, and whether it starts
        by migrating stragglers rather than by its ranks draining on their own."""
        k = self.cfg.check_every
        trigger = list(self.plan.stages[stage + 1].drained)
        ready = max((int(self.drain[r]) for r in trigger), default=0)
        when = max(k * math.ceil(ready / k), k * (after // k + 1))
        if self.cfg.migrate_max > 0 and trigger and stage not in self.no_migration:
            # The trigger ranks are down to migrate_max live responses in all once the
            # (migrate_max+1)-th longest of their responses has ended.
            lens = np.sort(self.length[np.isin(self.rank, trigger)])
            few = int(lens[-(self.cfg.migrate_max + 1)]) if len(lens) > self.cfg.migrate_max else 0
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
        moves = []
        for r in target.drained:
            for i in np.nonzero((self.rank == r) & (self.length > step))[0]:
                moves.append(int(i))
        saved = self.live.copy(), self.psum.copy(), self.rank.copy()
        placed = []
        for i in moves:
            span = slice(step + 1, int(self.length[i]) + 1)
            ts = np.arange(span.start, span.stop)
            # Peak KV tokens each resident would hold over the response's remaining steps.
            peaks = (self.psum[residents, span] + self.live[residents, span] * ts + self.kv_base[i] + ts).max(axis=1)
            fits = [r for r, p in zip(residents, peaks) if p <= budget[r]]
            if not fits:
                self.live, self.psum, self.rank = saved
                return None
            dst = min(fits, key=lambda r: (self.live[r, step + 1], r))
            self._move(i, dst, step)
            placed.append((i, dst))
        return self._moved(placed, step)

    def _move(self, i: int, dst: int, step: int) -> None:
        """Response i continues on rank `dst` from decode step step + 1."""
        span = slice(max(step, int(self.start[i])) + 1, int(self.length[i]) + 1)
        src = int(self.rank[i])
        for arr, val in ((self.live, 1), (self.psum, int(self.kv_base[i]))):
            arr[src, span] -= val
            arr[dst, span] += val
        self.rank[i] = dst

    def _moved(self, moves: list[tuple[int, int]], step: int) -> float:
        """Book moves already made (their KV as it stood at `step`); the seconds they take. Moves
        between distinct pairs run at once, so the busiest rank's sends or receives set the time,
        each over the link between its ranks (as `CostModel.transfer_s` books expert moves)."""
        cost, kv_total = self.cost, 0
        timed = []
        for i, dst in moves:
            kv_bytes = int(self.prompt[i] + max(step - int(self.start[i]), 0)) * self.shape.kv_bytes_per_token
            src = int(self.origin[i])
            timed.append((src, dst, kv_bytes / cost.link_bytes_per_s(src, dst)))
            for r in (src, dst) if self.timelines is not None else ():
                self.timelines[r].mark("migrate", "1 moved")
            kv_total += kv_bytes
            self.origin[i] = dst
        seconds = busiest_load(timed)
        self.result.migrated += len(moves)
        self.result.migrated_kv_bytes += kv_total
        self.drain[:] = 0
        np.maximum.at(self.drain, self.rank, self.length)
        return seconds

    def _shrink(self, stage: int, new: int, step: int, extra_s: float) -> None:
        """The transition from `stage` to `new` (its expert moves plus `extra_s` of KV moves)."""
        plan, cost = self.plan, self.cost
        members = np.array(plan.stages[stage].members, dtype=np.int64)
        seconds = extra_s + max(cost.transfer_s(plan.transfers(stage, new)), cost.shrink_fixed_s)
        self._transition(members, seconds)
        for r in members if self.timelines is not None else ():
            self.timelines[r].mark("stage", f"stage {new}: {len(plan.stages[new].members)} ranks")
        self.result.transitions.append((step, stage, new, seconds))
        leaving = np.setdiff1d(members, plan.stages[new].members)
        self.detached_at[leaving] = self.now
        self.result.timeline.append((self.now, len(plan.stages[new].members)))

    def _run_online(self, rule) -> int:
        """Decode with the online rule deciding at every check; returns the final stage."""
        stage, step, k = 0, 0, self.cfg.check_every
        while step < self.steps_total:
            end = min(k * (step // k + 1), self.steps_total)
            self._decode(stage, step + 1, end)
            step = end
            if step >= self.steps_total:
                break
            done = self.length <= step
            d = rule.decide(stage, step, self.rank, np.clip(step + 1 - self.start, 0, self.tokens), done)
            for i, dst in d.moves:
                self._move(i, dst, step)
            seconds = self._moved(list(d.moves), step)
            if d.stage != stage:
                self._shrink(stage, d.stage, step, seconds)
                stage = d.stage
            elif d.moves:  # a rebalance inside the group: one transition tick for its members
                self._transition(np.array(self.plan.stages[stage].members, dtype=np.int64), seconds)
                self.result.rebalances += 1
        return stage

    def run(self, rule=None) -> SimulatedRollout:
        plan, cost, res = self.plan, self.cost, self.result
        w = plan.ranks
        res.timeline.append((0.0, w))
        self._prefill()
        stage, step = (self._run_online(rule), self.steps_total) if rule is not None else (0, 0)
        while step < self.steps_total:
            if stage + 1 < len(plan.stages):
                check, by_migration = self._next_check(stage, step)
            else:
                check, by_migration = self.steps_total, False
            end = min(check, self.steps_total)
            self._decode(stage, step + 1, end)
            step = end
            if step >= self.steps_total:
                break
            extra = 0.0
            if by_migration:
                moved = self._migrate(stage, step)
                if moved is None:
                    self.no_migration.add(stage)
                    continue
                extra = moved
            drained = {r for r in range(w) if self.drain[r] <= step}
            new = plan.advance(stage, drained)
            if new == stage:
                continue
            self._shrink(stage, new, step, extra)
            stage = new
        if stage != 0:
            seconds = max(cost.transfer_s(plan.transfers(stage, 0)), cost.shrink_fixed_s) + cost.restore_extra_s
            for tl in self.timelines or ():  # the restoration pre-empts every lease
                if tl.states[-1] == "leased":
                    tl.mark("lease-end", "preempted")
            self._transition(np.arange(w), seconds)
            for tl in self.timelines or ():
                tl.mark("stage", f"stage 0: {w} ranks (restore)")
            res.transitions.append((step, stage, 0, seconds))
            res.timeline.append((self.now, w))
        total_ticks = int(self.ticks[0].sum())
        ranks = [RankLedger(r, dict(zip(STATES, map(float, self.sec[r]))), dict(zip(STATES, map(int, self.ticks[r]))),
                            self.timelines[r] if self.timelines is not None else RankTimeline())
                 for r in range(w)]
        res.ledger = Ledger(ranks=ranks, wall_s=self.now, total_steps=total_ticks)
        res.ledger.check()
        res.lower_bound_s = lower_bound_s(self.prompt, self.tokens, cost, plan.floor, w)
        return res


def simulate_rollout(plan: Plan, batch: Sequence[TraceRecord], cost: CostModel,
                     shape: ModelShape | None = None, config: SimConfig | None = None,
                     rule: OnlineRule | None = None) -> SimulatedRollout:
    """Carry out `plan` on `batch` (one rollout) and return its ledger; `Ledger.check` has passed.
    With `rule` (built on the same batch order), the online rule chooses the stages instead of
    `Plan.advance`, at every check, and moves requests as it says."""
    if not batch:
        raise ValueError("simulate_rollout: the batch is empty")
    return _Rollout(plan, batch, cost, shape or ModelShape(), config or SimConfig()).run(rule)
