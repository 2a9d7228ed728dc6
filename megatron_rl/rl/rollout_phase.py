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
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.timeline import Timeline
from elastic.trace import Trace, TraceRecord
from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.progress import Progress
from megatron_rl.rewards import Verdict
from megatron_rl.rl.leases import TrainingLeases, lease_metrics
from megatron_rl.rl.recording_engine import RecordingEngine
from megatron_rl.rollout.engine import Request
from megatron_rl.rollout.memory import memory_budget
from megatron_rl.rollout.rank_rollout import RankRollout, ResponseStream, gather_rollout, rank_engine, run_rank
from megatron_rl.rollout.rollout_plan import online_rule, plan_rollout, say_plan_notes
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
    """One request of a rollout phase: a fresh response, or (partial rollouts, rl/partial.py) a carried one resumed."""

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


@dataclass
class TrainingRollout:
    responses: list[Response]
    ledger: dict  # `Ledger.summary`: rank_seconds, rank_steps, dummy_share, ...
    stages: list[list[int]] = field(default_factory=list)
    layout: str = "natural"  # the layout the planner actually used (it may fall back)
    placement: str = ""  # digest of which rank generated each response, in canonical order
    wall_s: float = 0.0
    scored: dict[int, Verdict] = field(default_factory=dict)  # canonical index -> a lease's verdict
    lease: dict = field(default_factory=dict)  # `rl/leases.py:lease_metrics`
    timeline: Timeline | None = None  # per-rank states over the rollout's wall time


@dataclass(frozen=True)
class _Item:
    """What the planner reads of a response before it exists."""

    prompt_id: str
    sample: int
    prompt_len: int


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (1 << 62)


class RolloutPhase:
    def __init__(self, cfg: TrainerConfig, backend, model: Qwen3MoeModel, tokenizer: Tokenizer, rank: int,
                 world: int, store, resident_bytes: int = 0, leases: TrainingLeases | None = None,
                 out_dir: Path | None = None):
        """`resident_bytes`: training state that stays on the device through the rollout (the
        optimizer's, `training_state_bytes`); the planner prices it with the weights and KV.
        `leases`: what detached ranks do until the restore (None: they idle). `backend`: the run's
        `megatron_rl.backends.Backend`, built once by the trainer."""
        self.cfg, self.model, self.tok, self.rank, self.world = cfg, model, tokenizer, rank, world
        self.backend = backend
        self.dims = cfg.dims
        self.shape = None  # the model's shape the step's plan was priced on (its online rule's too)
        self.store = store  # the job's key-value store: the runtime's restore message goes through it
        self.budget = self._memory_budget(resident_bytes)
        self.leases = leases
        # The step in flight's finished responses stream to OUT/rollout/ (kept if the step fails).
        self.sink_dir = None if out_dir is None else Path(out_dir) / "rollout"
        # One engine per run: its KV cache and CUDA graphs are made once (the weights update in
        # place); `builds` and the graphs' `captures` go into every step's rollout report.
        self.engine: RecordingEngine | None = None
        self.builds = 0

    def _memory_budget(self, resident_bytes: int):
        """This device's budget. Every rank computes the same plan, so all ranks take the worst
        case: the least device memory and the most resident state of any rank."""
        weight = self.model.embedding.word_embeddings.weight
        budget = memory_budget(self.cfg.model, weight.element_size(), weight.device,
                               self.dims.ranks_per_node, resident_bytes, record_routes=True,
                               kv=self.cfg.generation.kv_kind.unit)
        if self.world > 1:
            worst = torch.tensor([budget.device_bytes, -budget.resident_bytes], dtype=torch.float64,
                                 device=weight.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MIN)
            budget = replace(budget, device_bytes=int(worst[0]), resident_bytes=-int(worst[1]))
        return budget

    def plan(self, items: list[_Item], history: Trace, known_prefix: dict | None = None):
        cfg = self.cfg
        plan, self.shape = plan_rollout(
            items, history, policy=cfg.elastic.policy, dims=self.dims, known_prefix=known_prefix,
            floor=cfg.elastic.floor, tailguard=cfg.elastic.tailguard, mcfg=cfg.model,
            dtype_bytes=self._dtype_bytes(), budget=self.budget, max_response_len=cfg.generation.max_response_len,
            shrink_cost_s=cfg.elastic.shrink_cost_s, device=self.model.embedding.word_embeddings.weight.device.type)
        # Training owns experts in Megatron's contiguous blocks; every rollout starts and ends there.
        assert dict(plan.stages[0].owners) == self.dims.block_owners(range(self.world))
        if self.rank == 0:
            say_plan_notes(plan)
        return plan

    def _dtype_bytes(self) -> int:
        return self.model.embedding.word_embeddings.weight.element_size()

    def run(self, step: int, prompts: list[Prompt], history: Trace) -> TrainingRollout:
        """The step's `prompts x group_size` responses, every one finished, in canonical order."""
        G, max_new = self.cfg.grpo.group_size, self.cfg.generation.max_response_len
        work = [Work(p.prompt_id, s, ids, max_new, 0) for p in prompts for ids in [self.tok.encode_prompt(p)]
                for s in range(G)]
        result, progress, outcomes = self.generate(step, work, history, prompts)
        assert all(progress[w.key][2] for w in work), "a response was left unfinished"
        result.responses = [Response(i, w.prompt_id, w.sample, w.prompt, *progress[w.key][:2],
                                     progress[w.key][0][-1] != self.tok.eos_id, progress[w.key][3])
                            for i, w in enumerate(work)]
        index = {w.key: i for i, w in enumerate(work)}
        result.scored = {index[k]: o for k, o in outcomes.items()}
        return result

    def generate(self, step: int, work: list, history: Trace, prompts: list[Prompt], *,
                 known_prefix: dict | None = None, stop=None) -> tuple[TrainingRollout, dict, dict]:
        """Carry out one rollout of `work` (`Work`: prompt ids, a resumed response's
        tokens so far after them, and the tokens it may still generate). Returns the result without
        responses, every request's (new tokens, their log-probs, finished, routes so far) by key, and the outcomes
        leases scored by key. `known_prefix` (tokens so far by key) goes to the planner and the
        online rule; `stop(engine)` builds the runtime's end rule (partial rollouts)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        items = [_Item(w.prompt_id, w.sample, w.prompt_len) for w in work]
        plan = self.plan(items, history, known_prefix)
        by_key = {w.key: w for w in work}
        mine = [Request(a.prompt_id, a.sample, by_key[a.prompt_id, a.sample].prompt,
                        by_key[a.prompt_id, a.sample].max_new) for a in plan.assignments if a.rank == self.rank]
        sampling = SamplingParams(temperature=cfg.generation.temperature, top_p=cfg.generation.top_p,
                                  greedy=False, seed=step_seed(cfg.seed, step))
        engine = self._engine(sampling, max(len(w.prompt) + w.max_new for w in work))
        engine.add(mine)
        engine.progress = Progress(f"step {step} rollout (rank {self.rank})", sum(r.max_new_tokens for r in mine),
                                   "tokens", enabled=self.rank == 0)
        engine.recorder.start({w.key: w.routes for w in work if w.routes is not None})
        kept = self.backend.keep_experts(self.model)
        spec = RankRollout(plan, self.rank, self.world, self.store, backend=self.backend,
                           rule=self._online_rule(plan, items, history, known_prefix),
                           status_interval=cfg.elastic.status_interval, stop=stop)
        leases = self.leases
        pool = None if leases is None else (lambda hit: leases.pool(engine.finished, prompts, hit))
        stream = None
        if self.sink_dir is not None:
            lease_rewards = {} if leases is None else {"lease_rewards": lambda: [
                [pid, s, o] for (pid, s), o in sorted(leases.outcomes().items())]}
            stream = ResponseStream(self.sink_dir, self.rank, engine, lambda r: {
                "prompt_id": r.prompt_id, "sample": r.sample, "tokens": r.tokens,
                "logprobs": engine.logprobs[r.key]}, kept=lease_rewards)
        # The recorded log-probs and routes travel with a migrated request.
        outcome = run_rank(spec, engine, pool=pool, stream=stream, carried=CarriedValues(engine))
        self.backend.restore_experts(self.model, kept)
        routes = engine.recorder.routes(engine.live + engine.pending)
        local = [(r.key, r.tokens, engine.logprobs.get(r.key, []), done, routes.get(r.key))
                 for done, rs in ((True, engine.finished), (False, engine.live + engine.pending)) for r in rs]
        scored = {} if leases is None else leases.outcomes()
        step_report = {} if leases is None else leases.step_report()
        gathered = gather_rollout(spec, engine, outcome, (local, scored, step_report))
        progress = {key: (tokens, logprobs, done, routes)
                    for g in gathered.payloads for key, tokens, logprobs, done, routes in g[0]}
        assert len(progress) == len(work) == sum(len(g[0]) for g in gathered.payloads), \
            "a request was lost or duplicated"
        summary = gathered.summary()
        scored = {k: o for g in gathered.payloads for k, o in g[1].items()}
        lease = lease_metrics(summary, [o.pool_report for o in gathered.outcomes],
                              [g[2] for g in gathered.payloads], len(scored))
        ranks = {(a.prompt_id, a.sample): a.rank for a in plan.assignments}
        placement = hashlib.sha256(json.dumps([ranks[w.key] for w in work]).encode()).hexdigest()[:16]
        timeline = Timeline.of_ledger(gathered.ledger, [o.pool_report for o in gathered.outcomes])
        summary["engine"] = {"builds": self.builds, "graph_captures": engine.runner.captures}
        return TrainingRollout([], summary, [list(s.members) for s in plan.stages],
                             plan.meta.get("effective_layout", plan.layout), placement,
                             time.perf_counter() - t0, {}, lease, timeline), progress, scored

    def _engine(self, sampling: SamplingParams, max_len: int) -> RecordingEngine:
        """The run's engine, reset for this step; built again only for a step whose sequences
        outgrow its KV cache (a new shape: its graphs are captured again). The cache's length is
        rounded up to a multiple of 64, so prompts of a few tokens more do not rebuild it."""
        cfg = self.cfg
        if self.engine is None or self.engine.cache.max_len < max_len:
            self.engine = rank_engine(self.model, sampling, cfg.generation.kv_kind,
                                      max_batch=cfg.generation.max_batch_per_rank, max_len=-(-max_len // 64) * 64,
                                      engine_cls=RecordingEngine, eos_id=self.tok.eos_id,
                                      temperature=cfg.generation.temperature)
            self.builds += 1
        else:
            self.engine.reset(sampling)
        return self.engine

    def _online_rule(self, plan, items: list[_Item], history: Trace, known_prefix: dict | None = None):
        """`adaptive` (torch backend): the online rule that re-plans, and migrates, as the rollout runs."""
        cfg = self.cfg
        return online_rule(plan, items, history, policy=cfg.elastic.policy, shape=self.shape,
                           status_interval=cfg.elastic.status_interval,
                           max_batch=cfg.generation.max_batch_per_rank,
                           max_response_len=cfg.generation.max_response_len, known_prefix=known_prefix,
                           kv=self.budget.kv)


def history_records(result: TrainingRollout, epoch: int) -> list[TraceRecord]:
    """The rollout's lengths in the trace format, for the planner's next predictions."""
    return [TraceRecord(r.prompt_id, epoch, r.sample, len(r.prompt), len(r.tokens), r.truncated)
            for r in result.responses]
