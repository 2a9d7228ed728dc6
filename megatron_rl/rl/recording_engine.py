"""The rollout engine as training runs it: as it decodes, it also records each sampled token's
log-prob under the sampling temperature (the rollout's, which the update compares with the training
policy's: rl/mismatch.py) and every position's routes (routing replay, rollout/route_record.py). One
engine serves the whole run (rl/rollout_phase.py): `reset` readies it for the next step with the
same KV cache and CUDA graphs.
"""
from __future__ import annotations

import struct

import torch

from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.route_record import RouteRecorder
from megatron_rl.rollout.sampling import SamplingParams


class RecordingEngine(RolloutEngine):
    """The rollout engine, also recording each sampled token's log-prob under the sampling
    temperature, and every position's routes (`recorder`, rollout/route_record.py)."""

    def __init__(self, *args, temperature: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.temperature = temperature
        self.logprobs: dict[tuple[str, int], list[float]] = {}
        self.tokens_done = 0
        self.recorder = RouteRecorder(self.model, self.cache)

    def step(self) -> int:
        # Only the engine's own forwards write routes (the sink's rows are its KV cache's).
        self.recorder.attach()
        try:
            return super().step()
        finally:
            self.recorder.detach()

    def release_memory(self) -> int:
        return super().release_memory() + self.recorder.sink.release_memory()

    def reclaim_memory(self) -> None:
        super().reclaim_memory()  # a new KV generation: decode graphs are captured again, with the new buffer
        self.recorder.sink.reclaim_memory()

    def capture_graphs(self) -> None:
        # A captured decode graph replays the route writes it was captured with.
        self.recorder.attach()
        try:
            super().capture_graphs()
        finally:
            self.recorder.detach()

    def _forked(self, src: int, dst: int, positions: int) -> None:
        self.recorder.sink.copy(src, dst, positions)

    def _emit(self, batch: list[Request], logits_BV: torch.Tensor) -> int:
        n = super()._emit(batch, logits_BV)
        for r in batch:
            if r.done(self.eos_id):
                self.recorder.keep(r)
        return n

    def _rides_with_tokens(self, logits_BV: torch.Tensor, toks_B: torch.Tensor) -> torch.Tensor:
        # On the device, as float64 bits: the host reads them with the tokens, not once per row.
        logp_BV = torch.log_softmax(logits_BV.double() / self.temperature, dim=-1)
        return logp_BV.gather(1, toks_B[:, None])[:, 0].contiguous().view(torch.long)

    def _record(self, batch: list[Request], values: list[int]) -> None:
        logp_B = struct.unpack(f"<{len(values)}d", struct.pack(f"<{len(values)}q", *values))  # exact bits
        for r, lp in zip(batch, logp_B):
            self.logprobs.setdefault(r.key, []).append(lp)
        self.tokens_done += len(batch)

    def reset(self, sampling: SamplingParams) -> None:
        """Ready for the next step's rollout with the same KV cache and graphs: that step's sampling,
        no requests (a stopped step's live ones give their slots back), no draws, no log-probs."""
        for r in self.live:
            self.cache.release(r.slot)
        self.sampling, self.pending, self.live, self.finished = sampling, [], [], []
        self.logprobs, self._drawn = {}, {}
        self.tokens_done = 0
