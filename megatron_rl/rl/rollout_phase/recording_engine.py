"""The rollout engine as training runs it: as it decodes, it also records each sampled token's
log-prob under the sampling temperature (the rollout's, which the update compares with the training
policy's: rl/update/mismatch.py) and every position's routes (routing replay, rollout/route_record.py). One
engine serves the whole run (rl/rollout_phase/phase.py): `reset` readies it for the next step with the
same KV cache and CUDA graphs.
"""
from __future__ import annotations

import struct

import torch

from megatron_rl.rollout.engine import Request, RolloutEngine, StepOutput
from megatron_rl.rollout.kv.batch import DecodeBatch, PrefillBatch
from megatron_rl.rollout.route_record import RouteRecorder
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.rollout.scheduler import Decode, Prefill


class RecordingEngine(RolloutEngine):
    """The rollout engine, also recording each sampled token's log-prob under the sampling
    temperature, and every position's routes (`recorder`, rollout/route_record.py)."""

    def __init__(self, *args, temperature: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.temperature = temperature
        self.logprobs: dict[tuple[str, int], list[float]] = {}
        self.tokens_done = 0
        self.recorder = RouteRecorder(self.model, self.cache)

    def _forward(self, batch: PrefillBatch | DecodeBatch, ids_BS: torch.Tensor, pos_BS: torch.Tensor,
                 mask_BS: torch.Tensor | None, logits_at_B: torch.Tensor | None = None) -> torch.Tensor:
        # Only the engine's own forwards write routes, at their batch's rows (the sink's rows are
        # its KV cache's); a captured decode graph replays the writes it was captured with.
        with self.recorder.recording(batch.rows):
            return super()._forward(batch, ids_BS, pos_BS, mask_BS, logits_at_B)

    def release_memory(self) -> int:
        return super().release_memory() + self.recorder.sink.release_memory()

    def reclaim_memory(self) -> None:
        super().reclaim_memory()  # a new KV generation: decode graphs are captured again, with the new buffer
        self.recorder.sink.reclaim_memory()

    def _forked(self, src: int, dst: int, positions: int) -> None:
        self.recorder.sink.copy(src, dst, positions)

    def update(self, work: Prefill | Decode, out: StepOutput) -> None:
        super().update(work, out)
        for r in work.requests:
            if r.done(self.eos_id):
                self.recorder.keep(r)

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
        """Ready for the next step's rollout (`RolloutEngine.reset`), and no log-probs."""
        super().reset(sampling)
        self.logprobs = {}
        self.tokens_done = 0
