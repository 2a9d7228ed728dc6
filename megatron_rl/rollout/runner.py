"""Run one rollout on W ranks: build the plan, start the ranks, carry the plan out, report.

The driver (the `flexfloor` process, or every rank under torchrun) builds the same batch and plan
deterministically; each rank builds its model with the experts stage 0 gives it, runs the elastic
runtime (vanilla is the one-stage plan), streams finished responses to `out_dir`, and rank 0 gathers
the ledger and the responses into the report.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.planning.layout import natural
from elastic.planning.plan import BACKEND_OWNERSHIP, Plan, static_plan
from elastic.planning.replan import ladder_plan
from elastic.planning.shape import MemoryBudget, ModelShape
from megatron_rl.errors import FlexFloorError
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.megatron_backend import backend_report
from megatron_rl.models.qwen3_moe import DTYPES
from megatron_rl.parallel.device import dist_backend, resolve_device
from megatron_rl.parallel.launch import ParallelContext, run_ranks
from megatron_rl.rollout.batch import load_trace, make_requests, select_epoch
from megatron_rl.rollout.config import RolloutConfig, check_experts_over_ranks
from megatron_rl.rollout.elastic_engine import ElasticRolloutEngine, MigratingEngine
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.engine_cost import engine_cost
from megatron_rl.rollout.faults import FailingExport, fault_rank
from megatron_rl.rollout.lease_jobs import distinct_ngram_reward, lease_jobs, sidecar_job
from megatron_rl.rollout.memory import memory_budget, model_shape, ranks_on_this_host


def model_config(cfg: RolloutConfig) -> MoEModelConfig:
    """The model's configuration; a checkpoint is checked here (headers only), before any rank starts.
    With a checkpoint its config.json decides; a `model:` other than the built-in default must then
    equal it, so a config never silently runs another model than it names."""
    if cfg.checkpoint is None:
        return cfg.model
    from megatron_rl.models.hf import check_hf_checkpoint, check_same_shape

    if cfg.model != MoEModelConfig():
        check_same_shape(cfg.checkpoint, cfg.model, where="model:")
    mcfg = check_hf_checkpoint(cfg.checkpoint)
    check_experts_over_ranks(mcfg.num_moe_experts, cfg.ranks, f"num_experts of {cfg.checkpoint}")
    return mcfg


def build_plan(cfg: RolloutConfig, mcfg: MoEModelConfig, batch, history, budget: MemoryBudget) -> Plan:
    plan = plan_rollout(batch, history, policy=cfg.policy, ranks=cfg.ranks, floor=cfg.floor,
                        tailguard=cfg.tailguard, mcfg=mcfg, dtype_bytes=DTYPES[cfg.dtype].itemsize,
                        budget=budget, ownership=BACKEND_OWNERSHIP[cfg.backend],
                        length_scale=cfg.batch.length_scale, device=resolve_device(cfg.device))
    if "floor_raised" in plan.meta:
        print(f"[rollout] planner: {plan.meta['floor_raised']}", file=sys.stderr)
    return plan


def rollout_budget(cfg: RolloutConfig, mcfg: MoEModelConfig) -> MemoryBudget:
    """Every rank computes on the device the config resolves to; one GPU (or this host's RAM over
    the ranks on it) stands for each rank's budget."""
    return memory_budget(mcfg, DTYPES[cfg.dtype].itemsize, torch.device(resolve_device(cfg.device)),
                         ranks_on_this_host(cfg.ranks))


def plan_rollout(batch, history, *, policy: str, ranks: int, floor: int | None, tailguard: bool,
                 mcfg: MoEModelConfig, dtype_bytes: int, budget: MemoryBudget,
                 max_response_len: int | None = None, shrink_cost_s: float | None = None,
                 ownership: str = "balanced", length_scale: float = 1.0, device: str = "cpu") -> Plan:
    """The plan of one rollout under `policy`, its memory checks priced against `budget`
    (`rollout/memory.py`); `max_response_len` bounds KV when history is empty; `ownership` is the
    backend's (`elastic.planning.plan.BACKEND_OWNERSHIP`). On CPU, chains are priced on this CPU
    engine's measured step and shrink (`engine_cost`, the run decoding `length_scale` of each trace
    length); on GPU on the shape's cost model; `shrink_cost_s` instead prices a shrink at that fixed
    cost on the shape's model. When a shrinking policy keeps every rank, stderr says why."""
    W, E = ranks, mcfg.num_moe_experts
    if E % W or W > E:
        raise FlexFloorError(f"the model's {E} experts cannot be divided over {W} ranks "
                             "(experts must be a multiple of ranks)")
    keys = [(r.prompt_id, r.sample) for r in batch]
    if policy == "vanilla":
        return static_plan("natural", natural(keys, W), W, E)
    from elastic.planning.planner import PlanError, make_plan
    from elastic.planning.release import ShapeCost

    floor = W if policy == "lengthsort" else (floor or max(1, W // 2))
    shape = model_shape(mcfg, dtype_bytes, budget, ranks_per_node=ranks_on_this_host(W))
    if shrink_cost_s is not None:
        cost = ShapeCost(shape, shrink_fixed_s=shrink_cost_s)
    else:
        cost = engine_cost(length_scale) if device == "cpu" else ShapeCost(shape)
    if policy == "adaptive" and ownership != "balanced":
        raise FlexFloorError("policy adaptive: its ladder of stages needs arbitrary expert ownership "
                             "(backend: torch); megatron-core holds only contiguous blocks")
    try:
        plan = make_plan(batch, history, ranks=W, floor=floor, shape=shape,
                         layout="planned" if policy == "adaptive" else policy,
                         tailguard=tailguard, max_response_len=max_response_len, cost=cost,
                         budget=budget, ownership=ownership)
    except PlanError as e:
        raise FlexFloorError(f"planner: {e}") from None
    if policy == "adaptive":
        return ladder_plan(plan, floor)
    if len(plan.stages) == 1 and floor < W:
        m = plan.meta
        print(f"[plan] {policy} floor {floor}: every rank stays: of {m['chains_priced']} chains priced "
              f"({m['chains_feasible']} fit the KV cache), keeping all {W} ranks has the fewest predicted "
              f"occupied rank-seconds ({m['predicted_occupied_rank_s']:.3g}; rollout "
              f"{m['predicted_rollout_s']:.3g} s, a shrink {cost.shrink_s(1, W):.3g} s)",
              file=sys.stderr, flush=True)
    return plan


def online_rule(plan: Plan, batch, history, *, shape: ModelShape, status_interval: int,
                max_batch: int, length_scale: float = 1.0, max_response_len: int | None = None,
                migrate: bool = True):
    """The online rule of an `adaptive` plan, priced on this engine (`engine_cost`); `batch` in
    `plan.assignments` order. It reasons in trace tokens: the driver divides the run's by
    `length_scale`. On this engine a step costs the same in any group, so a shrink can only
    lengthen the rollout: the rule runs without its latency guard and, like `planned`, shrinks
    when the objective's occupied rank-seconds say it pays."""
    from elastic.planning.online import OnlineOptions, online_model
    from elastic.planning.replan import OnlineRule

    cap = plan.meta["predictor"]["cap"] if isinstance(plan.meta.get("predictor"), dict) else None
    model = online_model(batch, history, cap or max_response_len, OnlineOptions(migrate=migrate))
    plan.meta["online"] = {"siblings": model.fit.to_dict(), "migrate": migrate}
    return OnlineRule(plan, [r.prompt_len for r in batch], model, engine_cost(length_scale),
                      shape, check_every=max(1, round(status_interval / length_scale)),
                      max_slowdown=None, max_batch=max_batch)


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


def _rank_main(ctx: ParallelContext, cfg: RolloutConfig, mcfg: MoEModelConfig, requests: list[Request],
               plan: Plan, out_dir: str | None, quiet: bool, rule=None):
    from elastic.runtime.pool import IdlePool
    from elastic.runtime.runtime import ElasticRuntime, ledger_of, transitions_of
    from elastic.runtime.transport import make_transport
    from megatron_rl.rollout.kv_cache import kv_cache_slots, slot_bytes

    rank, dtype = ctx.rank, DTYPES[cfg.dtype]
    held = [e for e, rs in plan.stages[0].owners.items() if rank in rs]
    if cfg.checkpoint is not None:
        from megatron_rl.models.hf import load_hf_checkpoint

        model = load_hf_checkpoint(cfg.checkpoint, dtype, experts=held)
    else:
        from megatron_rl.models.qwen3_moe import Qwen3MoeModel

        model = Qwen3MoeModel(mcfg, held, dtype)
        model.init_weights(cfg.seed)
    model.to(ctx.device).eval()
    # Fresh Request objects: the engine appends tokens to them, and the caller's may be shared
    # between rollouts of one world.
    mine = [replace(r, tokens=[]) for r, a in zip(requests, plan.assignments) if a.rank == rank]
    max_len = max([len(r.prompt) + r.max_new_tokens for r in requests] + [1])
    # After the weights: the KV cache takes what the device has left (all of max_batch_per_rank on CPU).
    per_slot = slot_bytes(mcfg.num_layers, mcfg.num_query_groups, max_len, mcfg.kv_channels, dtype)
    slots = kv_cache_slots(ctx.device, per_slot, cfg.kv_memory_fraction, cfg.max_batch_per_rank)
    engine = RolloutEngine(model, cfg.sampling, slots, max_len)
    engine.add(mine)
    sink = None
    if out_dir is not None:
        sink = open(Path(out_dir) / f"responses.rank{rank}.jsonl", "w", encoding="utf-8")
    written = [0]

    def flush_finished():
        if sink is not None and len(engine.finished) > written[0]:
            for r in engine.finished[written[0]:]:
                sink.write(json.dumps({"prompt_id": r.prompt_id, "sample": r.sample, "tokens": r.tokens}) + "\n")
            sink.flush()
            written[0] = len(engine.finished)

    online = None
    if cfg.backend == "megatron":
        from megatron_rl.rollout.megatron_elastic_engine import MegatronElasticEngine

        elastic_engine = MegatronElasticEngine.on_gpu(engine, rank, ctx.world)  # NCCL only, no host staging
    elif rule is not None:
        from elastic.runtime.online import OnlineDriver

        elastic_engine = MigratingEngine(engine, ctx.world, make_transport(cfg.transport))
        online = OnlineDriver(rule, [(a.prompt_id, a.sample) for a in plan.assignments],
                              [a.rank for a in plan.assignments], rank, cfg.batch.length_scale)
    else:
        elastic_engine = ElasticRolloutEngine(engine, ctx.world, make_transport(cfg.transport))
    hit = cfg.fault is not None and rank == fault_rank(plan)
    if hit and cfg.fault == "fail-transfer":
        elastic_engine = FailingExport(elastic_engine)
    jobs = lease_jobs(cfg.leases, finished=engine.finished, score=lambda r: distinct_ngram_reward(r.tokens),
                      sidecar=sidecar_job(cfg.leases, cfg.sidecar, rank, ctx.world),
                      fault=cfg.fault if hit else None)
    pool = IdlePool(jobs, lease_s=cfg.lease_s, grace_s=cfg.lease_grace_s)
    # The plan's longest predicted response, in this run's scaled tokens, is the predicted
    # restoration tick (one tick of prefill before it) that caps every lease.
    predicted = plan.meta.get("predicted_max_len")
    predicted_ticks = None if predicted is None else 1 + predicted * cfg.batch.length_scale
    runtime = ElasticRuntime(elastic_engine, plan, rank, ctx.store, status_interval=cfg.status_interval, pool=pool,
                             progress=None if quiet else _progress(time.perf_counter()),
                             after_step=flush_finished, predicted_ticks=predicted_ticks, online=online)
    try:
        outcome = runtime.run()
    except BaseException:
        # Nothing lost on failure: what finished is already streamed; add the ledger so far.
        if out_dir is not None and runtime.ledger is not None:
            (Path(out_dir) / f"ledger.rank{rank}.json").write_text(json.dumps(runtime.ledger.to_dict()))
        raise
    finally:
        flush_finished()
        if sink is not None:
            sink.close()
    responses = [{"prompt_id": r.prompt_id, "sample": r.sample, "tokens": r.tokens} for r in engine.finished]
    gathered = [None] * ctx.world if rank == 0 else None
    dist.gather_object((outcome, responses), gathered, dst=0)
    if rank != 0:
        return None
    outcomes = [g[0] for g in gathered]
    all_responses = [r for g in gathered for r in g[1]]
    ledger = ledger_of(outcomes)
    ledger.check()
    report = ledger.summary(sum(len(r["tokens"]) for r in all_responses))
    report.update(
        policy=cfg.policy, floor=plan.floor, tailguard=plan.tailguard,
        stages=[list(s.members) for s in plan.stages], **transitions_of(outcomes),
        responses=len(all_responses), responses_sha256=responses_sha256(all_responses),
        migrated=sum(o.migrated for o in outcomes),
        per_rank=[o.ledger.to_dict() for o in outcomes],
        pool={str(o.ledger.rank): o.pool_report for o in outcomes if o.pool_report},
        moe=backend_report(cfg.backend),
        device=ctx.device.type, transport=cfg.transport,
        freed_bytes={str(o.ledger.rank): o.freed_bytes for o in outcomes if o.freed_bytes},
    )
    return report, all_responses


@dataclass
class RolloutJob:
    """Everything a rank needs for one rollout, built identically on the driver or every rank."""

    cfg: RolloutConfig
    mcfg: MoEModelConfig
    requests: list[Request]  # in plan.assignments order
    plan: Plan
    out_dir: str | None
    rule: object | None = None  # `adaptive`: the online rule (elastic.planning.replan.OnlineRule)


def prepare(cfg: RolloutConfig, out_dir: str | None = None) -> RolloutJob:
    from megatron_rl.models.megatron_backend import require_backend

    require_backend(cfg.backend)
    if cfg.backend == "megatron" and cfg.dtype == "float64":
        raise FlexFloorError("backend 'megatron': megatron-core runs bfloat16 or float32, not dtype float64")
    if "sglang" in cfg.leases:
        from megatron_rl.rollout.sglang_lease import require_sglang

        require_sglang()
    if {"sidecar", "sglang"} & set(cfg.leases):
        cfg.sidecar.preflight()
    mcfg = model_config(cfg)
    trace = load_trace(cfg.batch, cfg.seed)
    batch, history = select_epoch(trace, cfg.batch.epoch)
    budget = rollout_budget(cfg, mcfg)
    plan = build_plan(cfg, mcfg, batch, history, budget)
    if cfg.backend == "megatron":
        from megatron_rl.rollout.megatron_elastic_engine import check_plan

        check_plan(plan)
    requests = make_requests(batch, cfg.batch, cfg.seed, mcfg.vocab_size)
    order = {(r.prompt_id, r.sample): i for i, r in enumerate(requests)}
    requests = [requests[order[(a.prompt_id, a.sample)]] for a in plan.assignments]
    rule = None if cfg.policy != "adaptive" else online_rule(
        plan, batch, history, shape=model_shape(mcfg, DTYPES[cfg.dtype].itemsize, budget,
                                                ranks_per_node=ranks_on_this_host(cfg.ranks)),
        status_interval=cfg.status_interval, max_batch=cfg.max_batch_per_rank, length_scale=cfg.batch.length_scale)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        # A reused folder must not mix an earlier (failed) run's files with this run's.
        for pattern in ("responses.rank*.jsonl", "ledger.rank*.json", "responses.jsonl", "report.json"):
            for stale in Path(out_dir).glob(pattern):
                stale.unlink()
        (Path(out_dir) / "plan.json").write_text(plan.to_json())
    return RolloutJob(cfg, mcfg, requests, plan, out_dir, rule)


def rank_jobs(ctx: ParallelContext, jobs: list[RolloutJob], quiet: bool):
    """This rank's part of every prepared job, in order, inside an existing world (what
    `run_rollouts` runs on each rank; benchmarks call it to share a world with other measurements).
    Returns (report, responses) per job on rank 0, None per job on the other ranks."""
    return [_rank_main(ctx, j.cfg, j.mcfg, j.requests, j.plan, j.out_dir, quiet, j.rule) for j in jobs]


def run_rollouts(cfgs: list[RolloutConfig], out_dirs: list[str | None] | None = None,
                 quiet: bool = False):
    """Several rollouts, one after another, in one world of ranks (side-by-side benchmarks and
    tests pay the start-up once). Returns a list of (report, responses); None on torchrun ranks != 0.
    """
    out_dirs = out_dirs or [None] * len(cfgs)
    # One world: one rank count, one device and one process-group backend (transports that share
    # it, as both do on CPU, may differ from job to job).
    worlds = {(c.ranks, resolve_device(c.device), dist_backend(resolve_device(c.device), c.transport)) for c in cfgs}
    if len(worlds) != 1:
        raise FlexFloorError(f"rollouts in one world must share ranks, device and process-group backend, "
                             f"got {sorted(worlds)}")
    (_, device, backend), = worlds
    jobs = [prepare(c, d) for c, d in zip(cfgs, out_dirs)]
    return run_ranks(rank_jobs, cfgs[0].ranks, jobs, quiet, timeout_s=max(c.timeout_s for c in cfgs),
                     device=device, transport="direct" if backend == "nccl" else "host")


def run_rollout(cfg: RolloutConfig, out_dir: str | None = None, quiet: bool = False):
    """Returns (report, responses) on the driver; None on non-zero torchrun ranks."""
    out = run_rollouts([cfg], [out_dir], quiet)
    return None if out is None else out[0]
