"""One rank's generation engine: batched prefill and decode over a KV cache.

The engine owns this rank's requests and KV cache; the model's MoE layers own the route to the
experts (a dispatcher). One call of `step()` is one synchronous EP step: a single forward through
every MoE layer, whether it prefills newly admitted requests, decodes the live ones, or, with
nothing local to do, routes zero tokens (`dummy_step`, Megatron's `dummy_forward`) so the other
ranks' all-to-alls still complete. Finished requests leave the batch at once.

A step is schedule -> execute -> update (vLLM V1's engine core): the scheduler (scheduler.py)
says what runs, a `Prefill` or a `Decode`; `execute` runs its forward (the cache's batch for it,
kv/batch.py, through the attention, kv/attention.py) and samples, returning the chosen tokens
(`StepOutput`); `update` appends them and retires the finished requests.

What a request is, and when it ends, is request.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.models.moe import MoELayer
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rollout.decode_step import AUTO_DECODE, DecodeOptions, DecodeRunner, HostReadback, to_device
from megatron_rl.rollout.kv.attention import Attention, KVForward, decode_kernel
from megatron_rl.rollout.kv.batch import DecodeBatch, PrefillBatch
from megatron_rl.rollout.kv.cache import KVLayout
from megatron_rl.rollout.kv.kind import SLOTS, KVKind
from megatron_rl.rollout.request import Request
from megatron_rl.rollout.sampling import SamplingParams, choose_tokens, draws
from megatron_rl.rollout.scheduler import Decode, Prefill, Scheduler


@dataclass(frozen=True)
class StepOutput:
    """What a step's forward chose, read back in its one copy: a token per request, and the values
    a subclass rode with them (`_rides_with_tokens`)."""

    tokens: list[int]
    rides: list[int]


class RolloutEngine:
    """Everything it allocates (KV cache, token ids, draws) is on the model's device; only the
    requests' bookkeeping and the chosen tokens live on the host. `max_batch` sequences of `max_len`
    positions at most: the KV cache's (`kv`, the run's KV kind: rollout/kv/kind.py, sized to the
    device by `within` before the engine is built; the slot cache may then hold fewer).

    A decode step reads one thing back from the device: the chosen tokens (with the count of
    misrouted rows in the same copy). `decode` says how decode steps run (rollout/decode_step.py):
    CUDA graphs (default: on CUDA), one per batch bucket, captured before the first decode step
    that can use it (`capture_graphs` captures at once), or the graphs' padded path eagerly; and
    the attention: the Triton decode kernel where it runs, else torch.
    """

    def __init__(self, model: Qwen3MoeModel, sampling: SamplingParams, max_batch: int, max_len: int,
                 eos_id: int | None = None, *, kv: KVKind = SLOTS, decode: DecodeOptions = AUTO_DECODE):
        cfg = model.config
        self.model, self.sampling, self.eos_id, self.device = model, sampling, eos_id, model.device
        self.cache = kv.cache(KVLayout.of(cfg, model.dtype, self.device), max_batch, max_len)
        self.attention = Attention(self.cache, decode_kernel(decode.attention, self.device, cfg.kv_channels,
                                                             model.dtype))
        self.scheduler = Scheduler(self.cache)
        self.runner = DecodeRunner(model, self.cache, self._forward, decode)
        slots = self.cache.slots
        # Rows routed to an expert their rank does not hold, counted by every layer's bank on the
        # device; read with the step's tokens (a step's tokens, as many values riding with them, the count).
        self._misrouted = torch.zeros(1, dtype=torch.long, device=self.device)
        self._readback = HostReadback(self.device, 2 * slots + 1)
        # Each response's uniform draws, one row per KV slot, made when it is admitted (sampling only).
        self._draws = None if sampling.greedy else \
            torch.zeros(slots + 1, max_len, dtype=torch.float64, device=self.device)
        self._drawn: dict[int, tuple[str, int]] = {}  # slot -> the response whose draws it holds
        self.finished: list[Request] = []

    @property
    def pending(self) -> list[Request]:
        return self.scheduler.pending

    @property
    def live(self) -> list[Request]:
        return self.scheduler.live

    def capture_graphs(self) -> None:
        """Capture the decode graphs now (else before the first decode step that replays one)."""
        if self.runner.graphs_wanted and self.runner._graphable():
            with torch.inference_mode():
                self._share_counter()
                self.runner._refresh_copies()
                self.runner.capture()

    def release_memory(self) -> int:
        """Free the KV cache and the graphs' memory (a detached rank's lease); returns the cache's bytes."""
        self.runner.release()
        return self.cache.release_memory()

    def reclaim_memory(self) -> None:
        self.cache.reclaim_memory()  # a new generation: the graphs are captured again before use

    def reset(self, sampling: SamplingParams) -> None:
        """Ready for another rollout with the same KV cache and graphs: `sampling`, no requests (the
        live ones of a stopped rollout give their sequences back), no draws."""
        self.scheduler.clear()
        self.sampling, self.finished, self._drawn = sampling, [], {}

    def add(self, requests: list[Request]) -> None:
        self.scheduler.add(requests)

    def has_work(self) -> bool:
        return bool(self.pending or self.live)

    @property
    def load(self) -> int:
        """Requests on this rank not yet finished (what the drain check counts)."""
        return len(self.pending) + len(self.live)

    def kv_report(self) -> dict:
        """The KV cache's figures for the rollout report (summed over ranks by the runner)."""
        s, c = self.scheduler, self.cache
        return {"prefill_tokens_requested": s.prefill_requested, "prefill_tokens_computed": s.prefill_computed,
                "pages_shared": c.pages_shared, "preemptions": s.preempted, "kv_bytes": c.nbytes if c.k else 0}

    @torch.inference_mode()
    def step(self) -> int:
        """One forward: schedule, execute, update; returns the number of tokens generated."""
        self._share_counter()
        work = self.scheduler.schedule()
        if work is None:
            self.dummy_step()
            return 0
        self.update(work, self.execute(work))
        return len(work.requests)

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """Join every MoE layer's collectives with zero tokens."""
        empty = torch.zeros(0, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
        for moe in self.model.moe_layers:
            moe(empty)

    def execute(self, work: Prefill | Decode) -> StepOutput:
        """The step's forward and its token choice, read back."""
        if self._draws is not None:
            self._fill_draws(work.requests)
        return self._prefill(work) if isinstance(work, Prefill) else self._decode(work)

    def update(self, work: Prefill | Decode, out: StepOutput) -> None:
        """The chosen tokens appended; the requests now done leave the batch."""
        self._record(work.requests, out.rides)
        for r, t in zip(work.requests, out.tokens):
            r.tokens.append(t)
        self.finished.extend(self.scheduler.retire(self.eos_id))

    def _forward(self, batch: PrefillBatch | DecodeBatch, ids_BS: torch.Tensor, pos_BS: torch.Tensor,
                 mask_BS: torch.Tensor | None, logits_at_B: torch.Tensor | None = None) -> torch.Tensor:
        """One forward of the model through the KV cache, as `batch` says (prefill or decode)."""
        return self.model(ids_BS, pos_BS, KVForward(self.attention, batch), mask_BS, logits_at_B)

    def _prefill(self, work: Prefill) -> StepOutput:
        admit, rows = work.requests, work.rows
        lens = [len(ids) for ids in work.seqs]
        S = max(lens)
        # Token ids, then each row's length, slot and tokens so far: one host buffer, one copy.
        host = torch.zeros(len(admit), S + 3, dtype=torch.long)
        for b, r in enumerate(admit):
            host[b, : lens[b]] = torch.tensor(work.seqs[b], dtype=torch.long)
            host[b, S:] = torch.tensor([lens[b], r.slot, len(r.tokens)])
        dev = to_device(host, self.device)
        shared = len(rows) < len(admit)
        comp = dev[to_device(torch.tensor(rows), self.device)] if shared else dev
        ids_BS, lens_B = comp[:, :S], comp[:, S]
        mask_BS = torch.arange(S, device=self.device)[None] < lens_B[:, None]
        batch = self.cache.prefill_batch([admit[b].slot for b in rows], [lens[b] for b in rows])
        logits_BV = self._forward(batch, ids_BS, batch.positions(self.device), mask_BS, lens_B - 1)
        self.cache.commit(batch)
        if shared:
            for b, u in enumerate(work.src):
                if rows[u] != b:
                    self.cache.fork(admit[rows[u]].slot, admit[b].slot)
                    self._forked(admit[rows[u]].slot, admit[b].slot, lens[b])
            logits_BV = logits_BV[to_device(torch.tensor(work.src), self.device)]
        # Each row's draw: its slot's row at its count of tokens (sampling only).
        u_B = None if self._draws is None else self._draws[dev[:, S + 1], dev[:, S + 2]]
        return self._sample(admit, logits_BV, u_B)

    def _decode(self, work: Decode) -> StepOutput:
        batch = work.requests
        slots = [r.slot for r in batch]
        lengths = self.cache.lengths
        logits_BV = self.runner.step([r.tokens[-1] for r in batch], slots, [lengths[s] for s in slots],
                                     [len(r.tokens) for r in batch])
        for s in slots:
            lengths[s] += 1
        inputs, B = self.runner.inputs, len(batch)
        u_B = None if self._draws is None else self._draws[inputs[:B, 1], inputs[:B, 3]]  # as in `_prefill`
        return self._sample(batch, logits_BV, u_B)

    def _sample(self, batch: list[Request], logits_BV: torch.Tensor, u_B: torch.Tensor | None) -> StepOutput:
        """Each row's token (`u_B`: its uniform draw, None when greedy), read back with what rides along."""
        toks_B = choose_tokens(logits_BV, self.sampling, u_B)
        rides_R = self._rides_with_tokens(logits_BV, toks_B)
        # The step's one read of device data: the tokens, what a subclass records of them, and the
        # misrouted count, in one copy.
        *values, misrouted = self._readback.read(torch.cat([toks_B, rides_R, self._misrouted]))
        if misrouted:
            next(m for m in self.model.moe_layers if isinstance(m, MoELayer)).experts.check_routing()
        return StepOutput(values[: len(batch)], values[len(batch):])

    def _share_counter(self) -> None:
        for moe in self.model.moe_layers:
            if isinstance(moe, MoELayer) and moe.experts.misrouted is not self._misrouted:
                moe.experts.misrouted = self._misrouted

    def _fill_draws(self, batch: list[Request]) -> None:
        """Admission: the draws of every step a response may take, into its slot's row (a
        migrated request gets its row at its first step here)."""
        for r in batch:
            if self._drawn.get(r.slot) != r.key:
                n = r.fixed_len if r.fixed_len is not None else r.max_new_tokens
                u = draws(self.sampling, r.key, range(len(r.tokens), n))
                self._draws[r.slot, len(r.tokens):n] = to_device(torch.tensor(u, dtype=torch.float64), self.device)
                self._drawn[r.slot] = r.key

    def _forked(self, src: int, dst: int, positions: int) -> None:
        """Slot `dst` took `src`'s first `positions` keys without computing them (a shared prefix):
        a subclass copies what it recorded of them."""

    def _rides_with_tokens(self, logits_BV: torch.Tensor, toks_B: torch.Tensor) -> torch.Tensor:
        """int64 values a subclass computes on the device from the step's logits and chosen tokens;
        they come back in the tokens' copy and reach `_record`, so recording adds no host read."""
        return toks_B[:0]

    def _record(self, batch: list[Request], values: list[int]) -> None:
        """The host values of `_rides_with_tokens`, before `batch` gets its new tokens."""
