"""The rollout phase of a training step: where `elastic/` plugs into the RL loop.

Every rank computes the same plan for the step's responses (vanilla: one stage, nobody leaves;
planned: predicted-long responses on resident ranks, the EP group shrinking to the floor), runs the
elastic runtime over the *training* model's own MoE layers, and all-gathers the finished responses.
The result is in canonical order (prompt order of the batch, then sample) whatever rank produced
each response, so everything after this phase is independent of the placement: with the same
tokens, `vanilla` and `planned` train identically.

Sampling seeds are keyed by (seed, step, prompt_id, sample), so a response's tokens depend on
nothing but its identity and the weights. The runtime moves experts during a shrink and rebuilds
them on restore; afterwards this phase puts the original expert modules back (with the restored,
checksum-verified weights) so the optimizer keeps training the same parameter objects.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from elastic.planning.plan import Plan
from elastic.planning.policies import policy_kind
from elastic.planning.shape import MemoryBudget
from elastic.runtime.stop import GroupsStop
from elastic.timeline import Timeline
from elastic.trace import Trace, TraceRecord
from megatron_rl.backend_rules import backend_rules
from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.parallel.launch import ParallelContext
from megatron_rl.progress import Progress
from megatron_rl.rewards import Verdict
from megatron_rl.rl.rollout_phase.leases import TrainingLeases, lease_metrics
from megatron_rl.rl.rollout_phase.recording_engine import RecordingEngine
from megatron_rl.rollout.engine import Request
from megatron_rl.rollout.memory import memory_budget
from megatron_rl.rollout.rank_rollout import Generated, RankHooks, RankRollout, RolloutResult, rank_engine
from megatron_rl.rollout.rollout_plan import RolloutPlanner, RolloutSetup, run_cost, say_plan_notes
from megatron_rl.rollout.route_record import CarriedValues
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.trainer_config import TrainerConfig


@dataclass
class Response:
    index: int  # canonical position: prompt index in the batch x group size + sample
    prompt_id: str
    sample: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]  # sampling log-probs the engine reported (temperature applied)
    truncated: bool  # hit max_response_len without EOS
    # [len(prompt) + len(tokens) - 1, L, K] expert ids the rollout routed every position it read
    # through (models/routes.py); None where none were recorded (a carried response of a checkpoint
    # written without them)
    routes: torch.Tensor | None = None


@dataclass(frozen=True)
class Work:
    """One request of a rollout phase: a fresh response, or (partial rollouts,
    rl/rollout_phase/partial.py) a carried one resumed."""

    prompt_id: str
    sample: int  # the request's sample number in the batch (`Carried.rid`)
    prompt: list[int]  # prompt ids, then the tokens so far (re-prefilled)
    max_new: int  # tokens it may still generate
    prefix: int  # tokens so far
    routes: torch.Tensor | None = None  # a carried response's routes so far (rollout/route_record.py)

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_id, self.sample)

    @property
    def prompt_len(self) -> int:  # what the planner reads: the re-prefill counts the tokens so far
        return len(self.prompt)


@dataclass(frozen=True)
class RolloutFigures:
    """What one training rollout measured, for the step's metrics."""

    ledger: dict  # `RolloutResult.summary` (rank_seconds, rank_steps, dummy_share, ...) and the engine's `engine`
    stages: list[list[int]]
    layout: str  # the layout the planner actually used (it may fall back)
    placement: str  # digest of which rank generated each response, in canonical order
    wall_s: float
    lease: dict  # `rl/rollout_phase/leases.py:lease_metrics`
    timeline: Timeline  # per-rank states over the rollout's wall time


@dataclass
class TrainingRollout:
    """What trains from a step's rollout: its responses in canonical order, the verdicts leases
    reached (by canonical index: the reward phase scores only the others), and what it measured."""

    responses: list[Response]
    scored: dict[int, Verdict]
    figures: RolloutFigures


@dataclass
class Generation:
    """One rollout of the phase (`RolloutPhase.generate`'s): every request as the rollout left it and
    the verdicts leases reached, by key; the end rule it ran under (partial rollouts: its last count
    of complete groups), and what it measured."""

    requests: dict[tuple[str, int], Generated]
    scored: dict[tuple[str, int], Verdict]
    figures: RolloutFigures
    stop: GroupsStop | None = None


@dataclass(frozen=True)
class _Item:
    """What the planner reads of a response before it exists."""

    prompt_id: str
    sample: int
    prompt_len: int


class EngineRecords:
    """The run's `RecordingEngine`'s records as the rank rollout reads them (`rank_rollout.Records`):
    each token's log-prob and every position's routes; both travel with a migrated request."""

    def __init__(self, engine: RecordingEngine):
        self.engine = engine
        self.carried = CarriedValues(engine)

    def logprobs(self, key: tuple[str, int]) -> list[float]:
        return self.engine.logprobs.get(key, [])

    def routes(self, unfinished: list[Request]) -> dict[tuple[str, int], torch.Tensor]:
        return self.engine.recorder.routes(unfinished)


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (1 << 62)


def worst_budget(cfg: TrainerConfig, model: Qwen3MoeModel, world: int, resident_bytes: int) -> MemoryBudget:
    """This device's budget for the planner, with `resident_bytes` of training state that stays on
    the device through the rollout (the optimizer's, `training_state_bytes`). Every rank computes
    the same plan, so all ranks take the worst case: the least device memory and the most resident
    state of any rank."""
    weight = model.embedding.word_embeddings.weight
    budget = memory_budget(cfg.model, weight.element_size(), weight.device, cfg.dims.ranks_per_node, resident_bytes,
                           record_routes=True, kv=cfg.generation.kv_kind.unit,
                           expert_copies=backend_rules(cfg.backend).expert_copies)
    if world > 1:
        worst = torch.tensor([budget.device_bytes, -budget.resident_bytes], dtype=torch.float64, device=weight.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MIN)
        budget = replace(budget, device_bytes=int(worst[0]), resident_bytes=-int(worst[1]))
    return budget


def training_planner(cfg: TrainerConfig, budget: MemoryBudget, dtype_bytes: int, device: str) -> RolloutPlanner:
    """`train`'s rollout planner, priced against `budget` (`worst_budget`) for the model's dtype on
    a `device` (its type)."""
    el, kind, dims = cfg.elastic, policy_kind(cfg.elastic.policy), cfg.dims
    shape = cfg.model.shape(dtype_bytes, budget, ranks_per_node=dims.ranks_per_node)
    return RolloutPlanner(kind, dims, kind.floor(dims.world, el.floor), el.tailguard, budget, shape,
                          cost=run_cost(shape, device, shrink_cost_s=el.shrink_cost_s),
                          check_every=el.status_interval, max_batch=cfg.generation.max_batch_per_rank,
                          max_response_len=cfg.generation.max_response_len)


class RolloutPhase:
    def __init__(self, cfg: TrainerConfig, backend, model: Qwen3MoeModel, tokenizer: Tokenizer, ctx: ParallelContext,
                 planner: RolloutPlanner, leases: TrainingLeases | None = None, sink: Path | None = None):
        """`backend`: the run's `megatron_rl.backends.Backend`, built once by the trainer; `ctx`:
        this rank's place (its store carries the runtime's restore message); `planner`: the run's
        (`build`); `leases`: what detached ranks do until the restore (None: they idle); `sink`:
        where the step in flight's finished responses stream (kept if the step fails)."""
        self.cfg, self.backend, self.model, self.tok, self.ctx = cfg, backend, model, tokenizer, ctx
        self.rank, self.world = ctx.rank, ctx.world
        self.planner, self.leases, self.sink = planner, leases, sink
        # One engine per run: its KV cache and CUDA graphs are made once (the weights update in
        # place); `builds` and the graphs' `captures` go into every step's rollout report.
        self.engine: RecordingEngine | None = None
        self.builds = 0

    @classmethod
    def build(cls, cfg: TrainerConfig, backend, model: Qwen3MoeModel, tokenizer: Tokenizer, ctx: ParallelContext,
              resident_bytes: int = 0, leases: TrainingLeases | None = None,
              out_dir: Path | None = None) -> RolloutPhase:
        """The run's rollout phase: its planner priced against the worst rank's budget (one
        collective), with `resident_bytes` of training state priced beside the weights and KV; the
        step in flight's finished responses stream to OUT/rollout/."""
        weight = model.embedding.word_embeddings.weight
        planner = training_planner(cfg, worst_budget(cfg, model, ctx.world, resident_bytes), weight.element_size(),
                                   weight.device.type)
        sink = None if out_dir is None else Path(out_dir) / "rollout"
        return cls(cfg, backend, model, tokenizer, ctx, planner, leases, sink)

    def setup(self, items: list[_Item], history: Trace, known_prefix: dict | None = None) -> RolloutSetup:
        setup = self.planner.setup(items, history, known_prefix)
        # Training owns experts in Megatron's contiguous blocks; every rollout starts and ends there.
        assert dict(setup.plan.stages[0].owners) == self.cfg.dims.block_owners(range(self.world))
        if self.rank == 0:
            say_plan_notes(setup.plan)
        return setup

    def run(self, step: int, prompts: list[Prompt], history: Trace) -> TrainingRollout:
        """The step's `prompts x group_size` responses, every one finished, in canonical order."""
        G, max_new = self.cfg.grpo.group_size, self.cfg.generation.max_response_len
        work = [Work(p.prompt_id, s, ids, max_new, 0) for p in prompts for ids in [self.tok.encode_prompt(p)]
                for s in range(G)]
        gen = self.generate(step, work, history, prompts)
        assert all(gen.requests[w.key].finished for w in work), "a response was left unfinished"
        responses = [Response(i, w.prompt_id, w.sample, w.prompt, g.tokens, g.logprobs, g.tokens[-1] != self.tok.eos_id,
                              g.routes) for i, w in enumerate(work) for g in [gen.requests[w.key]]]
        index = {w.key: i for i, w in enumerate(work)}
        return TrainingRollout(responses, {index[k]: o for k, o in gen.scored.items()}, gen.figures)

    def generate(self, step: int, work: list[Work], history: Trace, prompts: list[Prompt], *,
                 known_prefix: dict | None = None, stop: Callable[[RecordingEngine], GroupsStop] | None = None
                 ) -> Generation:
        """Carry out one rollout of `work` (`Work`: prompt ids, a resumed response's tokens so far
        after them, and the tokens it may still generate); `prompts` are what leases score against.
        `known_prefix` (tokens so far by key) goes to the planner and the online rule; `stop(engine)`
        builds the runtime's end rule (partial rollouts)."""
        t0 = time.perf_counter()
        setup = self.setup([_Item(w.prompt_id, w.sample, w.prompt_len) for w in work], history, known_prefix)
        engine = self._engine(step, work)
        rollout = RankRollout(setup.plan, setup.rule, self.ctx, self.backend,
                              status_interval=self.cfg.elastic.status_interval)
        requests = [Request(w.prompt_id, w.sample, w.prompt, w.max_new) for w in work]
        hooks = self._hooks(step, engine, prompts, rollout.mine(requests), None if stop is None else stop(engine))
        kept = self.backend.keep_experts(self.model)
        result = rollout.run(engine, requests, hooks)
        self.backend.restore_experts(self.model, kept)
        return self._generation(setup.plan, work, result, hooks.stop, t0)

    def _engine(self, step: int, work: list[Work]) -> RecordingEngine:
        """The run's engine, ready for this step: sampling keyed by the step, no requests, the
        carried responses' routes so far. Built again only for a step whose sequences outgrow its
        KV cache (a new shape: its graphs are captured again). The cache's length is rounded up to
        a multiple of 64, so prompts of a few tokens more do not rebuild it."""
        cfg = self.cfg
        sampling = SamplingParams(temperature=cfg.generation.temperature, top_p=cfg.generation.top_p,
                                  greedy=False, seed=step_seed(cfg.seed, step))
        max_len = max(len(w.prompt) + w.max_new for w in work)
        if self.engine is None or self.engine.cache.max_len < max_len:
            self.engine = rank_engine(self.model, sampling, cfg.generation.kv_kind,
                                      max_batch=cfg.generation.max_batch_per_rank, max_len=-(-max_len // 64) * 64,
                                      engine_cls=RecordingEngine, eos_id=self.tok.eos_id,
                                      temperature=cfg.generation.temperature)
            self.builds += 1
        else:
            self.engine.reset(sampling)
        self.engine.recorder.start({w.key: w.routes for w in work if w.routes is not None})
        return self.engine

    def _hooks(self, step: int, engine: RecordingEngine, prompts: list[Prompt], mine: list[Request],
               stop: GroupsStop | None) -> RankHooks:
        """What this phase plugs into the rank rollout: the engine's log-probs and routes, the
        leases (scoring against `prompts`), the sink, rank 0's progress line over `mine`, the end rule."""
        leases, progress = self.leases, None
        lease_hook = None if leases is None else (lambda finished, hit: leases.rollout(finished, prompts, hit))
        if self.rank == 0:
            line = Progress(f"step {step} rollout (rank {self.rank})", sum(r.max_new_tokens for r in mine), "tokens")

            def progress(tick: int, stage: int, members: int, live: int) -> None:
                line.update(engine.tokens_done)
        return RankHooks(records=EngineRecords(engine), leases=lease_hook, sink=self.sink, progress=progress, stop=stop)

    def _generation(self, plan: Plan, work: list[Work], result: RolloutResult, stop: GroupsStop | None,
                    t0: float) -> Generation:
        requests = result.requests()
        assert len(requests) == len(work), "a request was lost or duplicated"
        scored = {k: o for r in result.ranks for k, o in r.leases.scored.items()}
        summary = result.summary()
        pools = [o.pool_report for o in result.outcomes]
        lease = lease_metrics(summary, pools, [r.leases.sidecar for r in result.ranks], len(scored))
        summary["engine"] = {"builds": self.builds, "graph_captures": self.engine.runner.captures}
        ranks = {(a.prompt_id, a.sample): a.rank for a in plan.assignments}
        placement = hashlib.sha256(json.dumps([ranks[w.key] for w in work]).encode()).hexdigest()[:16]
        figures = RolloutFigures(summary, [list(s.members) for s in plan.stages],
                                 plan.meta.get("effective_layout", plan.layout), placement, time.perf_counter() - t0,
                                 lease, Timeline.of_ledger(result.ledger, pools))
        return Generation(requests, scored, figures, stop)


def history_records(result: TrainingRollout, epoch: int) -> list[TraceRecord]:
    """The rollout's lengths in the trace format, for the planner's next predictions."""
    return [TraceRecord(r.prompt_id, epoch, r.sample, len(r.prompt), len(r.tokens), r.truncated)
            for r in result.responses]
