"""One rank's elastic rollout, assembled once for `flexfloor rollout` (`megatron_rl/rollout_runner.py`)
and for `train` (`rl/rollout_phase.py`).

The caller builds its model, then its `RolloutEngine` by `rank_engine` (the one home of the KV
cache's sizing, for both) with this rank's requests added; the plan (and for `adaptive` the online
rule) comes from `rollout_plan.py`, and the run's `Backend` is handed down in `spec.backend`. Then,
on every rank:

    outcome = run_rank(spec, engine, pool=..., stream=..., carried=...)
    ... the caller's own work on this rank (the trainer puts its expert modules back) ...
    gathered = gather_rollout(spec, engine, outcome, payload, to=...)

`run_rank` picks the elastic engine by backend and policy (megatron-core's, the migrating one with
the online driver when there is a rule, else the plain one), injects the transfer fault on the
plan's fault rank, builds the lease pool, sets the predicted restoration tick, streams finished
responses to disk and, on failure, keeps the ledger so far beside them. `gather_rollout` collects
every rank's outcome (and the caller's payload) and checks the rollout's ledger.

Where a caller plugs in: `engine` (any `RolloutEngine`; the trainer's records log-probs, and
`carried` names them so they travel with a migrated request), `pool(fault_here)` (the side work of
detached ranks), `stream` (`ResponseStream`: the row written per response and the files kept on
failure), `spec.progress` (a per-tick callback), and the gather's `payload`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from elastic.planning.plan import Plan
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.faults import fault_rank
from megatron_rl.rollout.kv.cache import KVLayout
from megatron_rl.rollout.kv.kind import KVKind


@dataclass
class RankRollout:
    """What one rank's rollout is: its plan and place, and how it runs."""

    plan: Plan
    rank: int
    world: int
    store: Any  # the job's key-value store: the runtime's restore message goes through it
    # The run's `megatron_rl.backends.Backend`, handed down by the command or the trainer: which
    # elastic engine runs (`Backend.elastic_engine`).
    backend: Any
    transport: str = "direct"  # `elastic.runtime.transport.TRANSPORTS`
    rule: Any = None  # `adaptive`: the online rule (`elastic.planning.replan.OnlineRule`)
    # Run tokens per trace token (a trace replayed at a length scale); the plan and rule reason in
    # trace tokens.
    token_scale: float = 1.0
    status_interval: int = 1
    fault: str | None = None  # `fail-transfer`: the plan's fault rank fails its expert exports
    progress: Callable[[int, int, int, int], None] | None = None
    # Partial rollouts' end rule: `stop(engine)` builds the runtime's `stop` (rl/partial.py:GroupsStop).
    stop: Callable[[RolloutEngine], Any] | None = None

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


def elastic_engine(spec: RankRollout, engine: RolloutEngine, carried: dict | None = None):
    """The engine `elastic/` drives, by backend and policy (`Backend.elastic_engine`; with the
    online driver when a rule re-plans), failing its exports on the fault rank when asked."""
    from megatron_rl.rollout.faults import FailingExport

    elastic, online = spec.backend.elastic_engine(spec, engine, carried)
    if spec.fault == "fail-transfer" and spec.fault_here:
        elastic = FailingExport(elastic)
    return elastic, online


def run_rank(spec: RankRollout, engine: RolloutEngine, *, pool: Callable[[bool], Any] | None = None,
             stream: ResponseStream | None = None, carried: dict | None = None):
    """Carry the plan out on this rank; returns its `RankOutcome`. `pool(fault_here)` builds the
    idle pool of a detached rank (None: it idles); `carried` maps a request's key to per-token
    values recorded beside the engine that move with it when it migrates."""
    from elastic.runtime.runtime import ElasticRuntime

    elastic, online = elastic_engine(spec, engine, carried)
    runtime = ElasticRuntime(elastic, spec.plan, spec.rank, spec.store, status_interval=spec.status_interval,
                             pool=None if pool is None else pool(spec.fault_here), progress=spec.progress,
                             after_step=None if stream is None else stream.flush,
                             predicted_ticks=spec.predicted_ticks, online=online,
                             stop=None if spec.stop is None else spec.stop(engine))
    try:
        outcome = runtime.run()
    except BaseException:
        if stream is not None:
            stream.keep(runtime.ledger)
        raise
    if stream is not None:
        stream.close()
    return outcome


@dataclass
class GatheredRollout:
    """Every rank's outcome and payload (in rank order), and the rollout's checked ledger."""

    outcomes: list
    payloads: list
    ledger: Any  # `elastic.ledger.Ledger`
    tokens: int  # tokens generated over all ranks

    def summary(self) -> dict:
        """The ledger's summary with the stage transitions (`transitions_of`)."""
        from elastic.runtime.runtime import transitions_of

        out = self.ledger.summary(self.tokens)
        out.update(transitions_of(self.outcomes))
        return out


def gather_rollout(spec: RankRollout, engine: RolloutEngine, outcome, payload: Any = None,
                   to: int | None = None) -> GatheredRollout | None:
    """Collect (outcome, tokens, payload) of every rank: on every rank (`to` None), or on rank `to`
    only (the others get None)."""
    from elastic.runtime.runtime import ledger_of

    # Every request's tokens: a partial rollout ends with some still live.
    mine = (outcome, sum(len(r.tokens) for r in engine.finished + engine.live + engine.pending), payload)
    if to is None:
        gathered: list | None = [None] * spec.world
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [None] * spec.world if spec.rank == to else None
        dist.gather_object(mine, gathered, dst=to)
        if spec.rank != to:
            return None
    outcomes = [g[0] for g in gathered]
    ledger = ledger_of(outcomes)
    ledger.check()
    return GatheredRollout(outcomes, [g[2] for g in gathered], ledger, sum(g[1] for g in gathered))
