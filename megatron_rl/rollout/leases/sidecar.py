"""The sidecar: a held-out query queue served by a real HuggingFace checkpoint on a detached rank.

The paper's sidecar serves Qwen3-8B on GSM8K from the ranks a shrink frees. Here the sidecar
loads the checkpoint named by `sidecar.checkpoint` (any Qwen3-MoE directory this repo reads;
`tools/make_sidecar_model.py` trains one on the arithmetic task with no download), answers the
queries of `sidecar.queries` (JSONL rows `{prompt_id, prompt, answer}`) greedily, and scores every
answer with `sidecar.reward` against the row's reference.

Each rank serves its own share of the file (rows `rank::world`), so across ranks every query has one
server. The queue is served in passes: when a rank's share is done it starts again, so a sidecar
always has work while its rank is detached; `served` counts completions of every pass, while
`accuracy` counts each query once (its first completed answer; greedy answers repeat anyway).

Pre-emption never loses a query: each safe point is one decode step; on pre-emption, unfinished
queries drop their KV and go back to the front of the queue (`restarts`), to run from the start in
the next lease. Answers are scored only once complete, so a restart never counts twice.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from megatron_rl.config import require, require_seconds
from megatron_rl.data.prompts import DataConfig, load_prompts
from megatron_rl.data.tokenizer import TokenizerConfig, build_tokenizer
from megatron_rl.models.hf import check_hf_checkpoint, load_hf_checkpoint
from megatron_rl.rewards import RewardConfig, Scorer
from megatron_rl.rewards.math_answer import CORRECT
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams


@dataclass
class SGLangConfig:
    """The `sglang` lease's engine (`megatron_rl/rollout/leases/sglang.py`); GPU only."""

    mem_fraction_static: float = 0.2  # of the GPU, for the engine's weights and KV cache while serving
    drain_s: float = 1.0  # on pre-emption, running queries get this long, then are aborted
    reserve_bytes: int = 0  # free memory a lease leaves untouched beyond the engine's footprint
    release_slack_bytes: int = 64 * 2**20  # what a release may fail to hand back before it is an error

    def __post_init__(self):
        require(0 < self.mem_fraction_static < 1,
                f"sidecar.sglang.mem_fraction_static: expected in (0, 1), got {self.mem_fraction_static}")
        require_seconds(self.drain_s, "sidecar.sglang.drain_s")
        require(self.reserve_bytes >= 0 and self.release_slack_bytes >= 0,
                "sidecar.sglang.reserve_bytes/release_slack_bytes: expected >= 0")


@dataclass
class SidecarConfig:
    checkpoint: str | None = None  # a HuggingFace Qwen3-MoE directory (config.json + safetensors)
    queries: str | None = None  # JSONL of held-out queries: prompt (+ answer, prompt_id)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    max_new_tokens: int = 4  # the arithmetic sidecar answers in at most 3 characters + EOS
    batch: int = 16  # queries decoded together
    dtype: Literal["float32", "float64"] = "float32"
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def __post_init__(self):
        require(self.max_new_tokens > 0, f"sidecar.max_new_tokens: expected > 0, got {self.max_new_tokens}")
        require(self.batch > 0, f"sidecar.batch: expected > 0, got {self.batch}")

    def check(self, where: str, grace_s: float) -> None:
        """A sidecar lease needs both files, and a drain that fits the grace; checked when a config
        asks for one."""
        require(self.checkpoint is not None and self.queries is not None,
                f"{where}: the sidecar lease needs sidecar.checkpoint (a HuggingFace directory, see "
                "tools/make_sidecar_model.py) and sidecar.queries (a JSONL file)")
        require(2 * self.sglang.drain_s < grace_s,
                f"{where}: sidecar.sglang.drain_s ({self.sglang.drain_s}) must be under half the lease "
                f"grace ({grace_s}): a drain, then an abort, must both fit before LeaseTimeout")


    def preflight(self) -> None:
        """Read the checkpoint's headers and the queries on the driver, so a bad path or row stops
        the run in one line before any rank starts (the ranks load them again)."""
        check_hf_checkpoint(self.checkpoint)
        load_prompts(DataConfig(self.queries))


class SidecarQueue:
    """This rank's share of the queries, served in passes, with per-query scores and counters."""

    def __init__(self, cfg: SidecarConfig, rank: int = 0, world: int = 1, repeat: bool = True):
        self.cfg = cfg
        self.tok = build_tokenizer(cfg.tokenizer)
        self.scorer = Scorer(cfg.reward)
        self.rows = load_prompts(DataConfig(cfg.queries)).prompts[rank::world]
        self.prompts = [self.tok.encode_prompt(p) for p in self.rows]
        self.by_id = {p.prompt_id: p for p in self.rows}
        self.pending: deque[Request] = deque()
        self.repeat, self.passes = repeat, 0
        self.served = self.tokens = self.restarts = 0
        self.answered: dict[str, str] = {}  # prompt_id -> its first completed answer
        self.correct: dict[str, bool] = {}  # prompt_id -> that answer was right

    def done(self) -> bool:
        """Nothing left to serve: no queries, or the one pass made when passes do not repeat."""
        return not self.pending and (not self.rows or (self.passes > 0 and not self.repeat))

    def take(self) -> Request | None:
        """The next query (a new pass starts when the share is done); None when there is none."""
        if not self.pending:
            if self.done():
                return None
            self.pending.extend(Request(p.prompt_id, self.passes, ids, self.cfg.max_new_tokens)
                                for p, ids in zip(self.rows, self.prompts))
            self.passes += 1
        return self.pending.popleft()

    def give_back(self, requests: list[Request]) -> None:
        """Interrupted queries restart from scratch, first in line."""
        for r in reversed(requests):
            r.tokens.clear()
            self.pending.appendleft(r)
            self.restarts += 1

    def complete(self, r: Request) -> None:
        self.served += 1
        if r.prompt_id not in self.correct:
            answer = self.answered[r.prompt_id] = self.tok.decode(r.tokens)
            self.correct[r.prompt_id] = self.scorer.judge(answer, self.by_id[r.prompt_id]).outcome == CORRECT

    @property
    def max_len(self) -> int:
        return max(map(len, self.prompts), default=1) + self.cfg.max_new_tokens

    def report(self) -> dict:
        n = len(self.correct)
        return {"served": self.served, "distinct": n, "correct": sum(self.correct.values()),
                "accuracy": sum(self.correct.values()) / n if n else None, "tokens": self.tokens,
                "restarts": self.restarts, "passes": self.passes, "queued": len(self.pending)}


class SidecarJob:
    """The sidecar lease on this process's own torch engine (CPU or one GPU)."""

    name = "sidecar"

    def __init__(self, cfg: SidecarConfig, rank: int = 0, world: int = 1, repeat: bool = True):
        self.queue = SidecarQueue(cfg, rank, world, repeat)
        self.model = None

    def done(self) -> bool:
        return self.queue.done()

    def _engine(self) -> RolloutEngine:
        cfg = self.queue.cfg
        if self.model is None:  # loaded on the first lease, into the detached rank's memory
            self.model = load_hf_checkpoint(cfg.checkpoint, getattr(torch, cfg.dtype))
            self.model.eval()
        return RolloutEngine(self.model, SamplingParams(greedy=True), cfg.batch, self.queue.max_len,
                             self.queue.tok.eos_id)

    def run(self, preempted: Callable[[], bool]) -> None:
        q = self.queue
        engine = self._engine()
        while not preempted():
            while engine.load < q.cfg.batch and (r := q.take()) is not None:
                engine.add([r])
            if not engine.has_work():
                return
            q.tokens += engine.step()
            for r in engine.finished:
                q.complete(r)
            engine.finished.clear()
        q.give_back(engine.live + engine.pending)

    def report(self) -> dict:
        return self.queue.report()
