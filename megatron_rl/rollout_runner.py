"""Run one rollout on W ranks: build the plan, start the ranks, carry the plan out, report.

The driver (the `flexfloor` process, or every rank under torchrun) builds the same batch and plan
deterministically; each rank builds its model with the experts stage 0 gives it, runs the elastic
runtime (vanilla is the one-stage plan), streams finished responses to `out_dir`, and rank 0 gathers
the ledger and the responses into the report.

`flexfloor rollout`'s driver, as `trainer.py` is `train`'s: it stands above what it assembles
(rollout/, the backends), builds the run's `Backend`, the layout and the plan once, and hands them
down to the rank rollout.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from elastic.planning.dims import ParallelDims
from elastic.planning.lengths.guard import reserved_lengths
from elastic.planning.plan import Plan
from elastic.runtime.stop import GroupsStop, batch_stop
from megatron_rl.backends import Backend, backend
from megatron_rl.errors import FlexFloorError
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.parallel.device import dist_backend, resolve_device
from megatron_rl.parallel.launch import ParallelContext, run_ranks
from megatron_rl.parallel.torchrun import driver_process
from megatron_rl.preflight import preflight
from megatron_rl.rollout.batch import load_trace, make_requests, select_epoch
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.leases.jobs import RolloutLeases, distinct_ngram_reward, sidecar_job
from megatron_rl.rollout.rank_rollout import RankHooks, RankRollout, RolloutResult, rank_engine, response_row
from megatron_rl.rollout.rollout_plan import RolloutPlanner, model_config, say_plan_notes


def responses_sha256(responses: list[dict]) -> str:
    h = hashlib.sha256()
    for r in sorted(responses, key=lambda r: (r["prompt_id"], r["sample"])):
        h.update(json.dumps([r["prompt_id"], r["sample"], r["tokens"]]).encode())
        h.update(b"\n")
    return h.hexdigest()


def _progress(start: float):
    last = [0.0]

    def report(tick: int, stage: int, members: int, live: int) -> None:
        now = time.perf_counter()
        if now - last[0] >= 2.0 or live == 0:
            last[0] = now
            print(f"[rollout] {now - start:6.1f}s tick {tick:5d} stage {stage} ({members} ranks) "
                  f"unfinished {live}", file=sys.stderr, flush=True)
    return report


@dataclass
class RolloutRun:
    """One rollout as the driver sees it: the report (the ledger's summary, the plan, every rank's
    outcome) and every finished response (`prompt_id`, `sample`, `tokens`)."""

    report: dict
    responses: list[dict]


def _rank_main(ctx: ParallelContext, job: RolloutJob, quiet: bool) -> RolloutRun | None:
    """This rank's part of `job`: its model and engine, the plan carried out; the run on rank 0,
    None on the others."""
    cfg, moe = job.cfg, backend(job.cfg.backend)
    held = [e for e, rs in job.plan.stages[0].owners.items() if ctx.rank in rs]
    model = moe.build_model(job.mcfg, held, cfg.dtype, cfg.checkpoint, cfg.seed, ctx.device).eval()
    engine = _engine(job, model)
    hooks = _hooks(job, ctx, engine, quiet)
    result = job.rank_rollout(ctx, moe).run(engine, job.requests, hooks, to=0)
    if result is None:
        return None
    responses = [response_row(g) for g in result.finished()]
    moe_report = moe.rollout_report(model.dtype, ctx.device)
    return RolloutRun(_report(job, result, responses, moe_report, ctx.device, hooks.stop), responses)


def _engine(job: RolloutJob, model) -> RolloutEngine:
    """The rank's engine, after the weights: the KV cache takes what the device has left (all of
    max_batch_per_rank on CPU) for the longest request's positions."""
    cfg = job.cfg
    max_len = max([len(r.prompt) + r.max_new_tokens for r in job.requests] + [1])
    return rank_engine(model, cfg.sampling, cfg.kv_kind, max_batch=cfg.max_batch_per_rank, max_len=max_len,
                       memory_fraction=cfg.kv_memory_fraction)


def _hooks(job: RolloutJob, ctx: ParallelContext, engine: RolloutEngine, quiet: bool) -> RankHooks:
    """What `flexfloor rollout` plugs into the rank rollout: the leases, the `--out` folder the
    responses stream to, the progress lines and a partial rollout's end rule."""
    cfg, stop = job.cfg, None
    if cfg.partial.enabled:  # the end rule of a partial rollout (elastic/runtime/stop.py)
        stop = batch_stop(cfg.partial.rule(), [(a.prompt_id, a.sample) for a in job.plan.assignments], engine)
    return RankHooks(leases=_leases(cfg, ctx), sink=None if job.out_dir is None else Path(job.out_dir),
                     progress=None if quiet else _progress(time.perf_counter()), stop=stop)


def _leases(cfg: RolloutConfig, ctx: ParallelContext) -> Callable[[list[Request], bool], RolloutLeases]:
    """The rank rollout's `leases(finished, fault_here)`: the side work of this rank while it is
    detached; with no task to score, its rewards are `distinct_ngram_reward`."""
    def leases(finished: list[Request], fault_here: bool) -> RolloutLeases:
        return RolloutLeases.build(cfg.leases, finished, lambda r: distinct_ngram_reward(r.tokens),
                                   sidecar_job(cfg.leases.jobs, cfg.leases.sidecar, ctx.rank, ctx.world),
                                   cfg.fault if fault_here else None)
    return leases


def _report(job: RolloutJob, result: RolloutResult, responses: list[dict], moe: dict, device,
            stop: GroupsStop | None) -> dict:
    """The rollout report (rank 0): the ledger's summary, the plan, every rank's outcome; with a
    partial rollout's end rule (rank 0's), what it ended with and what would carry over."""
    cfg, plan, outcomes = job.cfg, job.plan, result.outcomes
    report = result.summary()
    report.update(
        policy=cfg.policy, floor=plan.floor, tailguard=plan.tailguard,
        stages=[list(s.members) for s in plan.stages],
        responses=len(responses), responses_sha256=responses_sha256(responses),
        migrated=sum(o.migrated for o in outcomes),
        per_rank=[o.ledger.to_dict() for o in outcomes],
        pool={str(o.ledger.rank): o.pool_report for o in outcomes if o.pool_report},
        moe=moe, device=device.type, transport=cfg.transport,
        freed_bytes={str(o.ledger.rank): o.freed_bytes for o in outcomes if o.freed_bytes},
        hosts={str(o.ledger.rank): o.host for o in outcomes}, ranks_per_node=job.dims.ranks_per_node,
        kv=kv_summary(cfg.kv, [r.kv for r in result.ranks]),
    )
    if stop is not None:
        left = [len(g.tokens) for g in result.unfinished()]
        report["partial"] = {"rule": cfg.partial.rule().describe, "target_groups": stop.target,
                             "groups": stop.groups, "groups_complete": stop.complete,
                             "carried": len(left), "carried_tokens": sum(left)}
    return report


def kv_summary(kind: str, per_rank: list[dict]) -> dict:
    """The rollout report's `kv`: the cache and its figures summed over ranks."""
    return {"cache": kind, **{k: sum(r[k] for r in per_rank) for k in per_rank[0]}}


@dataclass
class RolloutJob:
    """Everything a rank needs for one rollout, built identically on the driver or every rank."""

    cfg: RolloutConfig
    mcfg: MoEModelConfig
    dims: ParallelDims  # the command's layout, built once (`rollout_plan.model_config`)
    requests: list[Request]  # in plan.assignments order
    plan: Plan
    out_dir: str | None
    rule: object | None = None  # `adaptive`: the online rule (elastic.planning.online.rule.OnlineRule)

    def rank_rollout(self, ctx: ParallelContext, moe: Backend) -> RankRollout:
        """This rank's rollout of the job, on the run's backend `moe`."""
        cfg = self.cfg
        return RankRollout(self.plan, self.rule, ctx, moe, transport=cfg.transport, token_scale=cfg.batch.length_scale,
                           status_interval=cfg.status_interval, fault=cfg.fault)


def prepare(cfg: RolloutConfig, out_dir: str | None = None, device: str | None = None) -> RolloutJob:
    """`device`: the config's resolved device where the caller has it (`run_rollouts`)."""
    preflight(cfg.backend, cfg.dtype, cfg.leases)
    mcfg, dims = model_config(cfg)
    trace = load_trace(cfg.batch, cfg.seed)
    batch, history = select_epoch(trace, cfg.batch.epoch)
    # What the paged KV cache admits each response by: its length as the planner reserves it.
    reserved = reserved_lengths(batch, history, tailguard=cfg.tailguard) if cfg.kv_kind.predicts else None
    setup = RolloutPlanner.for_rollout(cfg, mcfg, dims, device or resolve_device(cfg.device)).setup(batch, history)
    plan = setup.plan
    if driver_process():
        say_plan_notes(plan)
    backend(cfg.backend).check_plan(plan)
    requests = make_requests(batch, cfg.batch, cfg.seed, mcfg.vocab_size, mcfg.max_position_embeddings, reserved)
    order = {(r.prompt_id, r.sample): i for i, r in enumerate(requests)}
    requests = [requests[order[(a.prompt_id, a.sample)]] for a in plan.assignments]
    _check_pool(cfg, requests)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        # A reused folder must not mix an earlier (failed) run's files with this run's.
        for pattern in ("responses.rank*.jsonl", "ledger.rank*.json", "lease_rewards.rank*.json", "responses.jsonl",
                        "report.json"):
            for stale in Path(out_dir).glob(pattern):
                stale.unlink()
        (Path(out_dir) / "plan.json").write_text(plan.to_json())
    return RolloutJob(cfg, mcfg, dims, requests, plan, out_dir, setup.rule)


def _check_pool(cfg: RolloutConfig, requests: list[Request]) -> None:
    """A request longer than `kv_pages` (a paged cache's pool) can ever hold stops the run before any
    rank starts."""
    if cfg.kv_pages is None:
        return
    r = max(requests, key=lambda r: len(r.prompt) + r.max_new_tokens)
    need = len(r.prompt) + r.max_new_tokens
    if -(-need // cfg.kv_page_size) > cfg.kv_pages:
        raise FlexFloorError(f"kv_pages {cfg.kv_pages}: expected a pool of at least {need} positions (response "
                             f"{r.prompt_id}/{r.sample} needs them), got {cfg.kv_pages * cfg.kv_page_size}; "
                             "raise kv_pages or use kv: slots")


def rank_jobs(ctx: ParallelContext, jobs: list[RolloutJob], quiet: bool) -> list[RolloutRun | None]:
    """This rank's part of every prepared job, in order, inside an existing world (what
    `run_rollouts` runs on each rank; benchmarks call it to share a world with other measurements).
    Returns a `RolloutRun` per job on rank 0, None per job on the other ranks."""
    return [_rank_main(ctx, j, quiet) for j in jobs]


def run_rollouts(cfgs: list[RolloutConfig], out_dirs: list[str | None] | None = None,
                 quiet: bool = False) -> list[RolloutRun] | None:
    """Several rollouts, one after another, in one world of ranks (side-by-side benchmarks and
    tests pay the start-up once). Returns a `RolloutRun` each; None on torchrun ranks != 0.
    """
    out_dirs = out_dirs or [None] * len(cfgs)
    # One world: one rank count, one device and one process-group backend (transports that share
    # it, as both do on CPU, may differ from job to job).
    devices = [resolve_device(c.device) for c in cfgs]
    worlds = {(c.ranks, d, dist_backend(d, c.transport)) for c, d in zip(cfgs, devices)}
    if len(worlds) != 1:
        raise FlexFloorError(f"rollouts in one world: expected one (ranks, device, process-group backend), "
                             f"got {sorted(worlds)}")
    (_, device, group), = worlds
    jobs = [prepare(c, o, d) for c, o, d in zip(cfgs, out_dirs, devices)]
    return run_ranks(rank_jobs, cfgs[0].ranks, jobs, quiet, timeout_s=max(c.timeout_s for c in cfgs),
                     device=device, transport="direct" if group == "nccl" else "host",
                     writes_to=next((o for o in out_dirs if o), None))


def run_rollout(cfg: RolloutConfig, out_dir: str | None = None, quiet: bool = False) -> RolloutRun | None:
    """The `RolloutRun` on the driver; None on non-zero torchrun ranks."""
    out = run_rollouts([cfg], [out_dir], quiet)
    return None if out is None else out[0]
