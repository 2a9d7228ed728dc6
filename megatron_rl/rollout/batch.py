"""The rollout batch: one epoch of a length trace (or of a synthetic one) turned into requests.

Trace replay: every response ends exactly at its traced length times `length_scale` (at least one
token), like ignore-EOS with a fixed output length. Prompt token ids are drawn from a stream keyed by
`(seed, prompt_id)`, so every sample of a prompt sees the same prompt on any rank.
"""
from __future__ import annotations

import hashlib
import math

import torch

from elastic.sim.synth import generate, preset
from elastic.trace import Trace, TraceRecord, read_trace
from megatron_rl.errors import FlexFloorError
from megatron_rl.rollout.config import BatchConfig
from megatron_rl.rollout.engine import Request


def load_trace(cfg: BatchConfig, seed: int) -> Trace:
    if cfg.trace is not None:
        return read_trace(cfg.trace)
    try:
        params = preset(cfg.preset, prompts=cfg.prompts, samples=cfg.samples, epochs=cfg.epochs)
    except ValueError as e:
        raise FlexFloorError(f"batch.preset: {e}") from None
    return generate(params, seed=seed)


def select_epoch(trace: Trace, epoch: int | None) -> tuple[list[TraceRecord], Trace]:
    """The batch (epoch `epoch`, default the last) and the history the planner may read."""
    e = trace.epochs[-1] if epoch is None else epoch
    if e not in trace.epochs:
        raise FlexFloorError(f"{trace.source}: no epoch {e} in the trace (epochs: {trace.epochs})")
    return trace.epoch(e), trace.before(e)


def prompt_tokens(seed: int, prompt_id: str, length: int, vocab: int) -> list[int]:
    h = int.from_bytes(hashlib.blake2b(f"{seed}\x00{prompt_id}".encode(), digest_size=8).digest(), "little")
    g = torch.Generator().manual_seed(h & ((1 << 63) - 1))
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def scaled_len(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def predicted_len(reserved: float, scale: float) -> int | None:
    """A response's reserved length (trace tokens: `elastic.planning.lengths.guard.reserved_lengths`) in run
    tokens, what the paged KV cache admits it by (`Request.predicted_len`); None where nothing bounds
    it (its cap decides)."""
    return None if math.isinf(reserved) else scaled_len(math.ceil(reserved), scale)


def make_requests(batch: list[TraceRecord], cfg: BatchConfig, seed: int, vocab: int,
                  max_positions: int | None = None, reserved: list[float] | None = None) -> list[Request]:
    """The batch's requests; with `max_positions` (the model's), a request whose prompt and response
    would run past the model's positions is refused, naming it, before any rank starts. `reserved`:
    each response's reserved length (`predicted_len`; the paged KV cache admits by it)."""
    out = []
    for r, q in zip(batch, reserved or [math.inf] * len(batch)):
        plen = min(cfg.max_prompt_len, scaled_len(r.prompt_len, cfg.length_scale))
        n = scaled_len(r.response_len, cfg.length_scale)
        if max_positions is not None and plen + n > max_positions:
            raise FlexFloorError(f"{cfg.trace or 'batch'}: response {r.prompt_id}/{r.sample} needs {plen} "
                                 f"prompt + {n} response tokens, beyond model.max_position_embeddings "
                                 f"({max_positions}); lower batch.length_scale or use a longer-context model")
        out.append(Request(r.prompt_id, r.sample, prompt_tokens(seed, r.prompt_id, plen, vocab),
                           max_new_tokens=n, fixed_len=n, predicted_len=predicted_len(q, cfg.length_scale)))
    return out
