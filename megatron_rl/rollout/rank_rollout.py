"""One rank's elastic rollout, assembled once for `flexfloor rollout` (`megatron_rl/rollout_runner.py`)
and for `train` (`rl/rollout_phase/phase.py`).

The caller builds its model, then its `RolloutEngine` by `rank_engine` (the one home of the KV
cache's sizing, for both); the plan (and for `adaptive` the online rule) comes from
`rollout_plan.py`, and the run's `Backend` is handed down in `RankRollout.backend`. Then, on every
rank:

    result = RankRollout(plan, rule, ctx, backend, ...).run(engine, requests, hooks, to=...)

`run` adds this rank's requests to the engine, picks the elastic engine by backend and policy
(megatron-core's, the migrating one with the online driver when there is a rule, else the plain
one), injects the transfer fault on the plan's fault rank, builds the lease pool, sets the predicted
restoration tick, streams finished responses to disk and, on failure, keeps the ledger so far
beside them. It then gathers every rank's `RankResult` (its finished and unfinished requests with
their tokens, log-probs and routes, its KV cache's figures, what its leases did and its ledger)
into one `RolloutResult`, whose ledger it checks.

Where a caller plugs in (`RankHooks`): `records` (what its engine records beside the tokens: the
trainer's log-probs and routes, which travel with a migrated request), `leases` (the side work of
a detached rank), `sink` (the folder finished responses stream to), `progress` (a per-tick
callback) and `stop` (a partial rollout's end rule).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from elastic.ledger import Ledger
from elastic.planning.plan import Plan
from elastic.runtime.runtime import DecodeHooks, ElasticRuntime, RankOutcome, ledger_of, transitions_of
from megatron_rl.parallel.launch import ParallelContext
from megatron_rl.rollout.elastic_engines.faults import FailingExport, fault_rank
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.kv.cache import KVLayout
from megatron_rl.rollout.kv.kind import KVKind
from megatron_rl.rollout.leases.jobs import LeaseOutcome, RolloutLeases

Key = tuple[str, int]  # (prompt_id, sample)


class Records(Protocol):
    """What an engine records beside the tokens (the trainer's `RecordingEngine`: each token's
    sampling log-prob and every position's routes), as the rank rollout reads it."""

    # key -> the values that move with a migrated request (`MigratingRolloutEngine`'s `carried`)
    carried: Any

    def logprobs(self, key: Key) -> list[float]:
        """The request's tokens' log-probs so far."""

    def routes(self, unfinished: list[Request]) -> dict[Key, torch.Tensor]:
        """Every request's routes so far on the host: the finished ones' and `unfinished`'s."""


@dataclass
class RankHooks:
    """Where a caller plugs into its rank's rollout; every one is optional."""

    records: Records | None = None
    # `leases(finished, fault_here)`: the leases of this rank while it is detached (None: it idles);
    # `finished` is the engine's list, which grows as the rollout runs.
    leases: Callable[[list[Request], bool], RolloutLeases] | None = None
    sink: Path | None = None  # finished responses stream to `sink/responses.rank<r>.jsonl` (`ResponseStream`)
    progress: Callable[[int, int, int, int], None] | None = None  # (tick, stage, members, live) at status checks
    # The runtime's end rule (`elastic.runtime.stop.GroupsStop`: partial rollouts), built over the engine.
    stop: Callable[[Any, Any], bool] | None = None


@dataclass
class Generated:
    """One request as the rollout left it on its rank: the tokens it generated (a resumed response:
    after its prompt and tokens so far), their sampling log-probs and the request's routes so far
    where the engine records them (empty, None otherwise), and whether it finished."""

    prompt_id: str
    sample: int
    tokens: list[int]
    finished: bool
    logprobs: list[float] = field(default_factory=list)
    # [read positions, L, K] expert ids (models/routes.py)
    routes: torch.Tensor | None = None

    @property
    def key(self) -> Key:
        return (self.prompt_id, self.sample)


def response_row(r: Request | Generated, logprobs: list[float] | None = None) -> dict:
    """A response as `flexfloor rollout` reports and streams it; the trainer streams its log-probs too."""
    row = {"prompt_id": r.prompt_id, "sample": r.sample, "tokens": r.tokens}
    if logprobs is not None:
        row["logprobs"] = logprobs
    return row


@dataclass
class RankResult:
    """One rank's part of a rollout: its requests (finished ones in the order they finished, then
    the unfinished ones a partial rollout's end rule left), its KV cache's figures
    (`RolloutEngine.kv_report`), what its leases did and its ledger (in `outcome`)."""

    outcome: RankOutcome
    finished: list[Generated]
    unfinished: list[Generated]
    kv: dict
    leases: LeaseOutcome

    @property
    def tokens(self) -> int:
        """Tokens this rank generated (a partial rollout ends with some requests still live)."""
        return sum(len(g.tokens) for g in self.finished + self.unfinished)


@dataclass
class RolloutResult:
    """Every rank's `RankResult`, in rank order, and the rollout's checked ledger."""

    ranks: list[RankResult]
    ledger: Ledger

    @property
    def outcomes(self) -> list[RankOutcome]:
        return [r.outcome for r in self.ranks]

    def summary(self) -> dict:
        """The ledger's summary with the stage transitions (`transitions_of`)."""
        out = self.ledger.summary(sum(r.tokens for r in self.ranks))
        out.update(transitions_of(self.outcomes))
        return out

    def finished(self) -> list[Generated]:
        return [g for r in self.ranks for g in r.finished]

    def unfinished(self) -> list[Generated]:
        return [g for r in self.ranks for g in r.unfinished]

    def requests(self) -> dict[Key, Generated]:
        """Every request of the rollout, finished or not, by key; each was on exactly one rank."""
        out = {g.key: g for g in self.finished() + self.unfinished()}
        if len(out) != sum(len(r.finished) + len(r.unfinished) for r in self.ranks):
            raise AssertionError("a request was duplicated")
        return out


class ResponseStream:
    """This rank's finished responses on disk as they finish: `folder/responses.rank<r>.jsonl`.

    If the rollout fails, the file stays, with the rank's ledger so far (`ledger.rank<r>.json`) and
    each of `kept` (name -> what to write as `name.rank<r>.json`) beside it: the work is on disk,
    not only in the dead processes. `row(request)` is the JSON object written per response."""

    def __init__(self, folder: str | Path, rank: int, engine: RolloutEngine,
                 row: Callable[[Request], dict], kept: dict[str, Callable[[], Any]] | None = None):
        self.folder, self.rank, self.engine, self.row = Path(folder), rank, engine, row
        self.kept, self.written = kept or {}, 0
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in ("ledger", *self.kept):  # a failed run's, from before a resume
            (self.folder / f"{stale}.rank{rank}.json").unlink(missing_ok=True)
        self.fh = open(self.folder / f"responses.rank{rank}.jsonl", "w", encoding="utf-8")

    def flush(self) -> None:
        if self.fh.closed or len(self.engine.finished) == self.written:
            return
        for r in self.engine.finished[self.written:]:
            self.fh.write(json.dumps(self.row(r)) + "\n")
        self.fh.flush()
        self.written = len(self.engine.finished)

    def close(self) -> None:
        if not self.fh.closed:
            self.flush()
            self.fh.close()

    def keep(self, ledger) -> None:
        """After a failure: everything this rank has of the rollout, for the user to inspect."""
        self.close()
        if ledger is not None:
            (self.folder / f"ledger.rank{self.rank}.json").write_text(json.dumps(ledger.to_dict()))
        for name, what in self.kept.items():
            (self.folder / f"{name}.rank{self.rank}.json").write_text(json.dumps(what()))


def rank_engine(model, sampling, kv: KVKind, *, max_batch: int, max_len: int, memory_fraction: float | None = None,
                engine_cls: type[RolloutEngine] = RolloutEngine, **extra) -> RolloutEngine:
    """This rank's engine over `model` (its weights loaded) with the run's KV kind `kv`, for
    `flexfloor rollout` and the trainer (`engine_cls`, `extra`: its recording engine and arguments):
    `max_batch` sequences of `max_len` positions at most, the cache sized to a GPU's
    `memory_fraction` less what is in use (`KVKind.within`: nano-vllm's rule; None: as configured)."""
    if memory_fraction is not None:
        kv = kv.within(KVLayout.of(model.config, model.dtype, model.device), max_batch, max_len, memory_fraction)
    return engine_cls(model, sampling, max_batch, max_len, kv=kv, **extra)


def elastic_engine(spec: RankRollout, engine: RolloutEngine, carried: Any = None):
    """The engine `elastic/` drives, by backend and policy (`Backend.elastic_engine`; with the
    online driver when a rule re-plans), failing its exports on the fault rank when asked."""
    elastic, online = spec.backend.elastic_engine(spec, engine, carried)
    if spec.fault == "fail-transfer" and spec.fault_here:
        elastic = FailingExport(elastic)
    return elastic, online


@dataclass(frozen=True)
class RankRollout:
    """What one rank's rollout is: its plan and place, and how it runs."""

    plan: Plan
    rule: Any  # `adaptive`: the online rule (`elastic.planning.online.rule.OnlineRule`), else None
    ctx: ParallelContext  # this rank, the world, the job's key-value store (the runtime's restore message)
    # The run's `megatron_rl.backends.Backend`, handed down by the command or the trainer: which
    # elastic engine runs (`Backend.elastic_engine`).
    backend: Any
    transport: str = "direct"  # `elastic.runtime.transport.TRANSPORTS`
    # Run tokens per trace token (a trace replayed at a length scale); the plan and rule reason in
    # trace tokens.
    token_scale: float = 1.0
    status_interval: int = 1
    fault: str | None = None  # `fail-transfer`: the plan's fault rank fails its expert exports

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world(self) -> int:
        return self.ctx.world

    @property
    def fault_here(self) -> bool:
        """Whether this rank is the one an injected fault hits (the first to leave)."""
        return self.rank == fault_rank(self.plan)

    @property
    def predicted_ticks(self) -> float | None:
        """The plan's longest predicted response in this run's tokens, plus one tick of prefill:
        the predicted restoration tick that caps every lease."""
        predicted = self.plan.meta.get("predicted_max_len")
        return None if predicted is None else 1 + predicted * self.token_scale

    def mine(self, requests: list[Request]) -> list[Request]:
        """This rank's requests of the plan, in its order, fresh (the engine appends tokens to them,
        and the caller's may be shared between rollouts)."""
        by_key = {r.key: r for r in requests}
        return [replace(by_key[a.prompt_id, a.sample], tokens=[]) for a in self.plan.assignments if a.rank == self.rank]

    def run(self, engine: RolloutEngine, requests: list[Request], hooks: RankHooks | None = None,
            to: int | None = None) -> RolloutResult | None:
        """Carry the plan out on this rank with its part of `requests` (every request of the rollout)
        on `engine`, then gather every rank's result: on every rank (`to` None), or on rank `to`
        only (the others get None)."""
        hooks = hooks or RankHooks()
        engine.add(self.mine(requests))
        leases = None if hooks.leases is None else hooks.leases(engine.finished, self.fault_here)
        outcome = self._carry_out(engine, hooks, leases)
        return self._gather(self._result(engine, outcome, hooks.records, leases), to)

    def _carry_out(self, engine: RolloutEngine, hooks: RankHooks, leases: RolloutLeases | None) -> RankOutcome:
        """The elastic runtime over `engine`; finished responses stream to the sink, and on failure
        the ledger so far (and the leases' verdicts) stay beside them."""
        records = hooks.records
        elastic, online = elastic_engine(self, engine, None if records is None else records.carried)
        stream = None
        if hooks.sink is not None:
            kept = {} if leases is None else {"lease_rewards": lambda: [
                [pid, s, o] for (pid, s), o in sorted(leases.outcome().scored.items())]}
            stream = ResponseStream(hooks.sink, self.rank, engine, lambda r: response_row(
                r, None if records is None else records.logprobs(r.key)), kept=kept)
        decode = DecodeHooks(progress=hooks.progress, after_step=None if stream is None else stream.flush,
                             stop=hooks.stop)
        runtime = ElasticRuntime(elastic, self.plan, self.rank, self.ctx.store, status_interval=self.status_interval,
                                 pool=None if leases is None else leases.pool, predicted_ticks=self.predicted_ticks,
                                 online=online, hooks=decode)
        try:
            outcome = runtime.run()
        except BaseException:
            if stream is not None:
                stream.keep(runtime.ledger)
            raise
        if stream is not None:
            stream.close()
        return outcome

    @staticmethod
    def _result(engine: RolloutEngine, outcome: RankOutcome, records: Records | None,
                leases: RolloutLeases | None) -> RankResult:
        unfinished = engine.live + engine.pending
        routes = {} if records is None else records.routes(unfinished)  # one host read

        def generated(r: Request, finished: bool) -> Generated:
            return Generated(r.prompt_id, r.sample, r.tokens, finished,
                             [] if records is None else records.logprobs(r.key), routes.get(r.key))
        return RankResult(outcome, [generated(r, True) for r in engine.finished],
                          [generated(r, False) for r in unfinished], engine.kv_report(),
                          LeaseOutcome() if leases is None else leases.outcome())

    def _gather(self, mine: RankResult, to: int | None) -> RolloutResult | None:
        if to is None:
            ranks: list | None = [None] * self.world
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [None] * self.world if self.rank == to else None
            dist.gather_object(mine, ranks, dst=to)
            if self.rank != to:
                return None
        ledger = ledger_of([r.outcome for r in ranks])
        ledger.check()
        return RolloutResult(ranks, ledger)
