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
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic.planning.plan import block_owners
from elastic.trace import Trace, TraceRecord
from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rollout.elastic_engine import ElasticRolloutEngine, MigratingEngine
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.runner import online_rule, plan_rollout
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


@dataclass
class RolloutResult:
    responses: list[Response]
    ledger: dict  # `Ledger.summary`: rank_seconds, rank_steps, dummy_share, ...
    stages: list[list[int]] = field(default_factory=list)
    layout: str = "natural"  # the layout the planner actually used (it may fall back)
    placement: str = ""  # digest of which rank generated each response, in canonical order
    wall_s: float = 0.0


@dataclass(frozen=True)
class _Item:
    """What the planner reads of a response before it exists."""

    prompt_id: str
    sample: int
    prompt_len: int


class RecordingEngine(RolloutEngine):
    """The rollout engine, also recording each sampled token's log-prob under the sampling temperature."""

    def __init__(self, *args, temperature: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.temperature = temperature
        self.logprobs: dict[tuple[str, int], list[float]] = {}

    def _emit(self, batch: list[Request], logits_BV: torch.Tensor) -> int:
        logp_BV = torch.log_softmax(logits_BV.double() / self.temperature, dim=-1)
        n = super()._emit(batch, logits_BV)
        for b, r in enumerate(batch):
            self.logprobs.setdefault(r.key, []).append(float(logp_BV[b, r.tokens[-1]]))
        return n


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (1 << 62)


class RolloutPhase:
    def __init__(self, cfg: TrainerConfig, model: Qwen3MoeModel, tokenizer: Tokenizer, rank: int,
                 world: int, store):
        self.cfg, self.model, self.tok, self.rank, self.world = cfg, model, tokenizer, rank, world
        self.store = store  # the job's key-value store: the runtime's restore message goes through it

    def plan(self, items: list[_Item], history: Trace):
        cfg = self.cfg
        plan = plan_rollout(items, history, policy=cfg.elastic.policy, ranks=self.world,
                            floor=cfg.elastic.floor, tailguard=cfg.elastic.tailguard, mcfg=cfg.model,
                            dtype_bytes=self._dtype_bytes(),
                            max_response_len=cfg.generation.max_response_len,
                            shrink_cost_s=cfg.elastic.shrink_cost_s)
        # Training owns experts in Megatron's contiguous blocks; every rollout starts and ends there.
        assert dict(plan.stages[0].owners) == block_owners(cfg.model.num_moe_experts, range(self.world))
        return plan

    def _dtype_bytes(self) -> int:
        return self.model.embedding.word_embeddings.weight.element_size()

    def run(self, step: int, prompts: list[Prompt], history: Trace) -> RolloutResult:
        from elastic.runtime.runtime import ElasticRuntime, ledger_of

        cfg, G = self.cfg, self.cfg.grpo.group_size
        t0 = time.perf_counter()
        encoded = [self.tok.encode(p.text) for p in prompts]
        items = [_Item(p.prompt_id, s, len(ids)) for p, ids in zip(prompts, encoded) for s in range(G)]
        plan = self.plan(items, history)
        index = {(it.prompt_id, it.sample): i for i, it in enumerate(items)}
        prompt_of = {p.prompt_id: ids for p, ids in zip(prompts, encoded)}
        max_new = cfg.generation.max_response_len
        mine = [Request(a.prompt_id, a.sample, prompt_of[a.prompt_id], max_new)
                for a in plan.assignments if a.rank == self.rank]
        sampling = SamplingParams(temperature=cfg.generation.temperature, top_p=cfg.generation.top_p,
                                  greedy=False, seed=step_seed(cfg.seed, step))
        engine = RecordingEngine(self.model, sampling, cfg.generation.max_batch_per_rank,
                                 max(map(len, encoded)) + max_new, self.tok.eos_id,
                                 temperature=cfg.generation.temperature)
        engine.add(mine)
        originals = [{e: moe.experts.get(e) for e in moe.experts.held()} for moe in self.model.moe_layers]
        online = None
        if cfg.elastic.policy == "adaptive":
            # Re-planning without migration: the recorded log-probabilities of a response stay on
            # the rank that generated its tokens.
            from elastic.runtime.online import OnlineDriver

            rule = online_rule(plan, items, history, mcfg=cfg.model, dtype_bytes=self._dtype_bytes(),
                               status_interval=cfg.elastic.status_interval,
                               max_batch=cfg.generation.max_batch_per_rank, max_response_len=max_new, migrate=False)
            online = OnlineDriver(rule, [(a.prompt_id, a.sample) for a in plan.assignments],
                                  [a.rank for a in plan.assignments], self.rank)
        wrap = MigratingEngine if online is not None else ElasticRolloutEngine
        outcome = ElasticRuntime(wrap(engine, self.world), plan, self.rank, self.store,
                                 status_interval=cfg.elastic.status_interval, online=online).run()
        self._reinstall(originals)
        local = [Response(index[r.key], r.prompt_id, r.sample, r.prompt, r.tokens,
                          engine.logprobs[r.key], r.tokens[-1] != self.tok.eos_id)
                 for r in engine.finished]
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, (outcome, local))
        responses = sorted((r for _, rs in gathered for r in rs), key=lambda r: r.index)
        assert [r.index for r in responses] == list(range(len(items))), "a response was lost or duplicated"
        outcomes = [o for o, _ in gathered]
        ledger = ledger_of(outcomes)
        ledger.check()
        summary = ledger.summary(sum(len(r.tokens) for r in responses))
        ranks = [0] * len(items)
        for a in plan.assignments:
            ranks[index[(a.prompt_id, a.sample)]] = a.rank
        return RolloutResult(responses, summary, [list(s.members) for s in plan.stages],
                             plan.meta.get("effective_layout", plan.layout),
                             hashlib.sha256(json.dumps(ranks).encode()).hexdigest()[:16],
                             time.perf_counter() - t0)

    def _reinstall(self, originals: list[dict]) -> None:
        """Put the pre-rollout expert modules back, holding the restored weights."""
        for moe, before in zip(self.model.moe_layers, originals):
            assert moe.experts.held() == sorted(before), "restore left a different set of experts"
            for e, module in before.items():
                now = moe.experts.get(e)
                if now is not module:
                    with torch.no_grad():
                        for p_old, p_new in zip(module.parameters(), now.parameters()):
                            p_old.copy_(p_new)
                    moe.experts.local_experts[str(e)] = module


def history_records(result: RolloutResult, epoch: int) -> list[TraceRecord]:
    """The rollout's lengths in the trace format, for the planner's next predictions."""
    return [TraceRecord(r.prompt_id, epoch, r.sample, len(r.prompt), len(r.tokens), r.truncated)
            for r in result.responses]
