"""Side work a detached rank can lease (see `elastic/runtime/pool.py`), both real and both reporting.

- `RewardScoringJob`: scores this rank's already finished responses while the tail still decodes,
  so the reward phase after the rollout has less left to do. The score function is the caller's
  (the trainer passes its task reward; the rollout CLI, which replays traces with synthetic prompts
  and has no task, passes `distinct_ngram_reward`, a degeneracy score RL recipes use as a penalty).
- `SidecarJob`: an auxiliary inference queue served by a second, small dense model (the paper's
  sidecar serves Qwen3-8B on GSM8K). Each safe point is one decode step; pre-empted queries go back
  to the queue and restart in the next lease.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams


def distinct_ngram_reward(tokens: list[int], n: int = 4) -> float:
    """Share of distinct n-grams in a response: 1.0 for no repetition, near 0 for a loop."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


class RewardScoringJob:
    name = "rewards"

    def __init__(self, finished: list[Request], score: Callable[[list[int]], float]):
        self.finished, self.score = finished, score
        self.rewards: dict[tuple[str, int], float] = {}

    def done(self) -> bool:
        return len(self.rewards) >= len(self.finished)

    def run(self, preempted: Callable[[], bool]) -> None:
        for r in list(self.finished):
            if preempted():
                return
            if r.key not in self.rewards:
                self.rewards[r.key] = self.score(r.tokens)

    def report(self) -> dict:
        vals = list(self.rewards.values())
        return {"scored": len(vals), "reward_mean": sum(vals) / len(vals) if vals else None}


def sidecar_config() -> MoEModelConfig:
    """A small dense model: one always-chosen expert makes the FFN a plain SwiGLU."""
    return MoEModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          kv_channels=16, num_moe_experts=1, moe_router_topk=1,
                          moe_ffn_hidden_size=128, vocab_size=256)


class SidecarJob:
    name = "sidecar"

    def __init__(self, queries: int, seed: int, max_new_tokens: int = 16, batch: int = 8):
        g = torch.Generator().manual_seed(seed)
        self.queue = deque(
            Request(f"q{i:05d}", 0, torch.randint(0, 256, (8,), generator=g).tolist(), max_new_tokens)
            for i in range(queries))
        self.batch, self.seed = batch, seed
        self.model: Qwen3MoeModel | None = None
        self.served = self.tokens = self.restarts = 0

    def done(self) -> bool:
        return not self.queue

    def _engine(self) -> RolloutEngine:
        if self.model is None:  # built on first lease, on the detached rank's memory
            self.model = Qwen3MoeModel(sidecar_config(), dtype=torch.float32)
            self.model.init_weights(self.seed)
            self.model.eval()
        return RolloutEngine(self.model, SamplingParams(greedy=True), self.batch, 64)

    def run(self, preempted: Callable[[], bool]) -> None:
        engine = self._engine()
        while (self.queue or engine.has_work()) and not preempted():
            while self.queue and engine.load < self.batch:
                engine.add([self.queue.popleft()])
            self.tokens += engine.step()
            self.served += len(engine.finished)
            engine.finished.clear()
        # Pre-empted: unfinished queries lose their KV and go back to the front of the queue.
        for r in reversed(engine.live + engine.pending):
            r.tokens.clear()
            self.queue.appendleft(r)
            self.restarts += 1

    def report(self) -> dict:
        return {"served": self.served, "tokens": self.tokens, "queued": len(self.queue),
                "restarts": self.restarts}
