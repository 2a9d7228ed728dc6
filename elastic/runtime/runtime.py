"""The elastic rollout runtime: carry a `Plan` out on an `ElasticEngine`, one rank's view.

Collective order (every rank runs this same sequence, which is what keeps gloo/NCCL from hanging):
1. setup: `new_group` for every stage of the plan, on every rank, in stage order, each warmed with
   one small all-reduce (NCCL creates a communicator at its first collective: warmed, a shrink is a
   routing swap, never a rendezvous); checksums of the held weights; a world barrier starts the clock.
2. decode loop of the active group: every `status_interval` ticks, an all-reduce of each member's
   unfinished-request count over the current stage's group; `Plan.advance` turns the drained set
   into the stage to be in (the same rule the simulator runs). On a stage change the whole old group
   moves experts (`Plan.transfers`, point-to-point in one global order, so no cycle can deadlock),
   survivors swap to the new group and owners at the same tick, and the leaving ranks detach.
3. detached ranks free their KV cache (their experts are already dropped) and serve the idle pool
   (leases) until the coordinator's restore message arrives, then re-allocate the cache.
   That message goes through the job's key-value store (the TCPStore every torch.distributed job
   has), not a point-to-point receive: gloo cannot poll a pending receive without blocking, and a
   detached rank must keep its main thread free to supervise leases.
4. restore: the coordinator (lowest member of the last stage) posts the restore message; the
   whole world moves experts back to stage 0's owners, swaps back to the world group, and checks the
   weights against the setup checksums. A mismatch is an error, never silently trained on.

Ledger ticks: each decode step and each shrink or restore is one tick of the global clock; a
detached rank accrues every tick it misses (split between `leased` and `idle` by its measured time).
Every collective runs under the process group's timeout (on NCCL with async error handling, so a
lost peer raises instead of hanging); a failure is re-raised as `ElasticFault` naming the rank,
stage and phase. Status and checksum buffers are made on the engine's device and, like expert
transfers, go through the engine's transport (direct, or staged through host memory).
"""
from __future__ import annotations

import itertools
import re
import socket
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from elastic.errors import shorten
from elastic.ledger import Ledger, RankLedger
from elastic.planning.plan import Plan
from elastic.runtime.clock import RankClock
from elastic.runtime.detached import IdlePoolLike, RestoreSignal, RunEnd, serve_detached
from elastic.runtime.groups import first_use, process_group
from elastic.runtime.interface import ElasticEngine
from elastic.runtime.online import OnlineDriver

TAG_EXPERT = 0
_rollout_ids = itertools.count()  # every rank builds its runtimes in the same order


def fault_cause(cause: BaseException | str) -> str:
    """A failed collective's error (gloo's carry a source path and advice): the sentence that says what happened."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", shorten(cause, 500))
    return text.split(". This is typically")[0]


class ElasticFault(RuntimeError):
    def __init__(self, rank: int, stage: int, phase: str, cause: BaseException | str):
        super().__init__(f"rank {rank}, stage {stage}, phase {phase}: {fault_cause(cause)}")
        self.rank, self.stage, self.phase = rank, stage, phase


@dataclass
class RankOutcome:
    ledger: RankLedger
    total_steps: int
    final_stage: int
    detached_at: int | None
    wall_s: float
    shrink_s: dict[int, float] = field(default_factory=dict)  # stage entered -> seconds
    restore_s: float = 0.0
    pool_report: dict = field(default_factory=dict)
    # Wall-clock (time.time) edges of this rank's ledger, and the state it ended in.
    start_wall: float = 0.0
    end_wall: float = 0.0
    end_state: str = "dummy"
    freed_bytes: dict = field(default_factory=dict)  # a detached rank's memory freed for its lease
    migrated: int = 0  # live requests this rank received from leaving ranks (online rule)
    host: str = field(default_factory=socket.gethostname)  # the host this rank ran on


def ledger_of(outcomes: list[RankOutcome]) -> Ledger:
    """The rollout's ledger from every rank's outcome.

    T runs from the first rank's start to the last rank's end on the shared wall clock. Ranks leave
    the start and end barriers a little apart; each rank's time outside its own span is added to the
    state it was in at that edge (waiting in the group at the start, its last state at the end), so
    the seconds conserve exactly instead of within the barrier skew.
    """
    start, end = min(o.start_wall for o in outcomes), max(o.end_wall for o in outcomes)
    for o in outcomes:
        o.ledger.lead("dummy", o.start_wall - start)
        o.ledger.add(o.end_state, end - o.end_wall, 0)
    return Ledger([o.ledger for o in outcomes], wall_s=end - start, total_steps=outcomes[0].total_steps)


def transitions_of(outcomes: list[RankOutcome]) -> dict:
    """The stage reached and the slowest rank's time per shrink (by stage entered) and restore."""
    shrink: dict[int, float] = {}
    for o in outcomes:
        for st, s in o.shrink_s.items():
            shrink[st] = max(shrink.get(st, 0.0), s)
    return {"final_stage": max(o.final_stage for o in outcomes),
            "shrink_latency_s": {str(k): v for k, v in sorted(shrink.items())},
            "restore_s": max(o.restore_s for o in outcomes)}


def _stage_group(members: tuple[int, ...], world: int):
    """The communicator of a stage: the world's, or one made once per member set (a training run
    plans every rollout anew; every rank meets the same plans in the same order)."""
    return dist.group.WORLD if len(members) == world else process_group(members)


def warm_groups(stages: list[tuple[int, ...]], groups: list, rank: int, transport, device) -> None:
    """One small all-reduce on every stage group this rank is a member of, once per group, so that
    no communicator is created later, in the middle of a shrink. Stages are nested and every rank
    walks them in the same order, so the members of each group reach its all-reduce together."""
    for members, group in zip(stages, groups):
        if rank in members and first_use(members):
            transport.all_reduce(torch.zeros(1, device=device), group)


def verify_restored(engine: ElasticEngine, before: dict[str, str], rank: int, stage: int) -> None:
    """The held weights after a restore against their pre-rollout checksums `before`; one
    all-reduce tells every rank whether any rank failed. A mismatch is an `ElasticFault`, never
    silently trained on."""
    bad = sorted(k for k, v in engine.checksums().items() if before.get(k) != v)
    bad += sorted(set(before) - set(engine.checksums()))
    flag = engine.transport.all_reduce(torch.tensor([len(bad)], device=engine.device))
    if bad:
        raise ElasticFault(rank, stage, "verify", f"restored weights differ from the pre-rollout checksums: {bad[:5]}")
    if int(flag) > 0:
        raise ElasticFault(rank, stage, "verify", "another rank's restored weights failed the checksum")


def _move_experts(engine: ElasticEngine, moves: list[tuple[int, int, int]], rank: int) -> None:
    for e, src, dst in moves:
        if rank == src:
            engine.transport.send(engine.export_expert(e), dst, TAG_EXPERT)
        elif rank == dst:
            engine.import_expert(e, engine.transport.recv(engine.empty_expert(), src, TAG_EXPERT))


@dataclass(frozen=True)
class DecodeHooks:
    """What the caller asks of the decode loop: `progress(tick, stage, members, live)` at each
    status check (on the group's first member), `after_step()` after each step, and `stop(engine,
    group)` (partial rollouts' end rule), whether the members end the loop with live requests left:
    one collective over the current group at a status check, so every member returns the same; the
    restore then runs as after the last token, and the caller takes the unfinished requests from
    the engine."""

    progress: Callable[[int, int, int, int], None] | None = None
    after_step: Callable[[], None] | None = None
    stop: Callable[[ElasticEngine, object], bool] | None = None


@dataclass
class RunState:
    """One run's state from its setup on, carried through the phases: every stage's communicator
    (in stage order), the held weights' checksums before the rollout (what the restore is verified
    against), the rank's clock, the tick it left at and its experts' bytes then, and each shrink's
    seconds (stage entered -> seconds)."""

    groups: list
    checksums: dict[str, str]
    clock: RankClock
    detached_at: int | None = None
    expert_bytes: int = 0
    shrink_s: dict[int, float] = field(default_factory=dict)


class ElasticRuntime:
    def __init__(self, engine: ElasticEngine, plan: Plan, rank: int, store, *, status_interval: int = 1,
                 pool: IdlePoolLike | None = None, predicted_ticks: float | None = None,
                 online: OnlineDriver | None = None, hooks: DecodeHooks = DecodeHooks()):
        self.engine, self.plan, self.rank = engine, plan, rank
        self.signal = RestoreSignal(store, f"flexfloor/rollout{next(_rollout_ids)}/restore")
        self.k = status_interval
        self.pool, self.predicted_ticks, self.hooks = pool, predicted_ticks, hooks
        # With `online`, the online rule chooses the stage at each status check and may move live
        # requests first (elastic/runtime/online.py); without, `Plan.advance`.
        self.online = online
        self.world = plan.ranks
        self.stage, self.phase = 0, "setup"
        self.ledger: RankLedger | None = None  # from the setup on: what a caller keeps after a failure

    # ---- helpers ------------------------------------------------------------------------------
    def _fault(self, e: BaseException) -> ElasticFault:
        return e if isinstance(e, ElasticFault) else ElasticFault(self.rank, self.stage, self.phase, e)

    def _use_stage(self, groups: list, stage: int) -> None:
        """Route through stage `stage` (`groups`: every stage's communicator); refuse an ownership
        that leaves an expert without a member."""
        owners = {e: self.plan.stages[stage].owner_of(e) for e in range(self.plan.num_experts)}
        members = set(self.plan.stages[stage].members)
        orphans = sorted(e for e, r in owners.items() if r not in members)
        if len(owners) != self.plan.num_experts or orphans:
            raise ElasticFault(self.rank, stage, self.phase, f"experts {orphans} have no owner in the group")
        self.engine.use_group(groups[stage], owners)

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> RankOutcome:
        try:
            return self._run()
        except BaseException as e:
            raise self._fault(e) from e

    def _run(self) -> RankOutcome:
        run = self._setup()
        clock = run.clock
        self._decode(run)
        if run.detached_at is not None:
            self.phase = "detached"
            end = serve_detached(self.engine, clock, self.signal, self.pool, self.predicted_ticks, run.expert_bytes)
            self.stage = end.stage
        else:
            end = self._announce_end(clock)
        total_ticks, restore_s = end.total_ticks, 0.0
        if self.stage != 0:
            restore_s = self._restore(run)
            total_ticks += 1
        dist.barrier()
        # The final barrier waits for the slowest rank: that wait is part of the last state held.
        last = "transition" if self.stage != 0 else "dummy"
        clock.settle(last, 0)
        wall_s = clock.t_prev - clock.t0
        return RankOutcome(clock.ledger, total_ticks, self.stage, run.detached_at, wall_s, run.shrink_s,
                           restore_s, end.pool_report, clock.start_wall, clock.start_wall + wall_s, last, end.freed,
                           self.online.migrated if self.online is not None else 0)

    # ---- the phases of a run, in order ----------------------------------------------------------
    def _setup(self) -> RunState:
        """Every stage's communicator (warmed), the full world's routing; the weights' checksums,
        which the restore is verified against; the clock starts once every rank is set up."""
        plan = self.plan
        plan.check()
        groups = [_stage_group(st.members, self.world) for st in plan.stages]
        warm_groups([st.members for st in plan.stages], groups, self.rank, self.engine.transport,
                    self.engine.device)
        checksums = self.engine.checksums()
        self._use_stage(groups, 0)
        self.ledger = RankLedger(self.rank)
        dist.barrier()
        return RunState(groups, checksums, RankClock.start(self.ledger))
    def _decode(self, run: RunState) -> None:
        """Decode steps, with a status check every `k` ticks, until the group has drained or this
        rank leaves it."""
        clock, stop, after_step = run.clock, self.hooks.stop, self.hooks.after_step
        self.phase = "decode"
        while True:
            if clock.tick % self.k == 0:
                status, live = self._status(run)
                if live == 0 or (stop is not None and stop(self.engine, run.groups[self.stage])):
                    return
                nxt, decision = self._decide(run, status)
                if nxt == self.stage and decision is not None and decision.moves:
                    # A rebalance inside the group: one transition tick for its members.
                    self.phase = "migrate"
                    moved = self.online.migrate(self.engine, decision.moves)
                    clock.book("transition")
                    if moved:
                        clock.ledger.mark("migrate", f"{moved} moved")
                    continue
                if nxt != self.stage:
                    if self._shrink(run, nxt, decision):
                        return
                    continue
            self.phase = "decode"
            state = "busy" if self.engine.load() > 0 else "dummy"
            if state == "busy":
                self.engine.step()
            else:
                self.engine.dummy_step()
            if after_step is not None:
                after_step()
            clock.book(state)

    def _status(self, run: RunState) -> tuple[torch.Tensor, int]:
        """The group's status (each rank's load, or with `online` each response's progress),
        all-reduced over the current group, and the live requests it counts."""
        self.phase = "status"
        group = run.groups[self.stage]
        if self.online is not None:
            status = torch.as_tensor(self.online.status(self.engine, group))
        else:
            status = torch.zeros(self.world, dtype=torch.long)
            status[self.rank] = self.engine.load()
            status = self.engine.transport.all_reduce(status.to(self.engine.device), group).cpu()
        live = int(status.sum())
        members = self.plan.stages[self.stage].members
        if self.hooks.progress is not None and self.rank == min(members):
            self.hooks.progress(run.clock.tick, self.stage, len(members), live)
        return status, live

    def _decide(self, run: RunState, status: torch.Tensor):
        """(the stage to be in, the online decision or None): the online rule's, checked to be
        every member's, or `Plan.advance` on the drained ranks."""
        if self.online is None:
            drained = {r for r in range(self.world) if status[r] == 0}
            return self.plan.advance(self.stage, drained), None
        decision = self.online.decide(self.stage, run.clock.tick)
        if (decision.stage != self.stage or decision.moves) and \
                not self.online.agree(self.engine, run.groups[self.stage], decision):
            raise ElasticFault(self.rank, self.stage, "decide",
                               "the members reached different online decisions from the same status")
        return decision.stage, decision

    def _shrink(self, run: RunState, nxt: int, decision) -> bool:
        """Enter stage `nxt`: the decision's request moves, then the expert moves; a leaving rank
        drops every expert (and must hold no live request). Whether this rank left."""
        plan, rank, moved, clock = self.plan, self.rank, 0, run.clock
        if self.online is not None:
            self.phase = "migrate"
            moved = self.online.migrate(self.engine, decision.moves)
        self.phase = "shrink"
        _move_experts(self.engine, plan.transfers(self.stage, nxt), rank)
        leaving = rank not in plan.stages[nxt].members
        if leaving and self.engine.load() != 0:
            raise ElasticFault(rank, self.stage, self.phase,
                               f"would leave with {self.engine.load()} live requests")
        run.expert_bytes = self.engine.expert_bytes() if leaving else 0
        for e in self.engine.held_experts():
            if leaving or rank not in plan.stages[nxt].owners[e]:
                self.engine.drop_expert(e)
        if not leaving:
            self._use_stage(run.groups, nxt)
        run.shrink_s[nxt] = clock.book("transition")
        if moved:
            clock.ledger.mark("migrate", f"{moved} moved")
        clock.ledger.mark("stage", f"stage {nxt}: {len(plan.stages[nxt].members)} ranks")
        self.stage = nxt
        if leaving:
            run.detached_at = clock.tick
        return leaving

    def _announce_end(self, clock: RankClock) -> RunEnd:
        """A rank still in the group at the end: its first member tells the detached ranks the
        rollout's ticks and final stage."""
        self.phase = "restore"
        if self.rank == min(self.plan.stages[self.stage].members):
            self.signal.post(clock.tick, self.stage)
        return RunEnd(clock.tick, self.stage)

    def _restore(self, run: RunState) -> float:
        """Back to the full world (the experts return to their first-stage owners), verified against
        the pre-rollout checksums on every rank; the seconds it took."""
        plan, rank = self.plan, self.rank
        self.phase = "restore"
        _move_experts(self.engine, plan.transfers(self.stage, 0), rank)
        for e in self.engine.held_experts():
            if rank not in plan.stages[0].owners[e]:
                self.engine.drop_expert(e)
        self._use_stage(run.groups, 0)
        self.phase = "verify"
        verify_restored(self.engine, run.checksums, rank, self.stage)
        restore_s = run.clock.settle("transition")
        run.clock.ledger.mark("stage", f"stage 0: {self.world} ranks (restore)")
        return restore_s
