"""One rank's generation engine: batched prefill and decode over a slot KV cache.

The engine owns this rank's requests and KV cache; the model's MoE layers own the route to the
experts (a dispatcher). One call of `step()` is one synchronous EP step: a single forward through
every MoE layer, whether it prefills newly admitted requests, decodes the live ones, or, with
nothing local to do, routes zero tokens (`dummy_step`, Megatron's `dummy_forward`) so the other
ranks' all-to-alls still complete. Finished requests leave the batch at once.

A request ends at its `fixed_len` when set (trace replay: ignore EOS, stop at the traced length),
else at EOS or `max_new_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_rl.models.moe import MoELayer
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rollout.decode_step import DecodeRunner
from megatron_rl.rollout.paged_kv import build_kv_cache
from megatron_rl.rollout.sampling import SamplingParams, choose_tokens, draws


@dataclass
class Request:
    prompt_id: str
    sample: int
    prompt: list[int]
    max_new_tokens: int
    fixed_len: int | None = None
    tokens: list[int] = field(default_factory=list)
    slot: int = -1
    # The planner's predicted response length (paged KV admission); None: the cap (fixed_len or max_new_tokens).
    predicted_len: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_id, self.sample)

    def done(self, eos_id: int | None) -> bool:
        if self.fixed_len is not None:
            return len(self.tokens) >= self.fixed_len
        if eos_id is not None and self.tokens and self.tokens[-1] == eos_id:
            return True
        return len(self.tokens) >= self.max_new_tokens

    def predicted_positions(self) -> int:
        """KV positions it is expected to end with: prompt + predicted response, at least what it holds."""
        cap = self.fixed_len if self.fixed_len is not None else self.max_new_tokens
        want = cap if self.predicted_len is None else min(cap, self.predicted_len)
        return len(self.prompt) + max(len(self.tokens) + 1, want)


class RolloutEngine:
    """Everything it allocates (KV cache, token ids, draws) is on the model's device; only the
    requests' bookkeeping and the chosen tokens live on the host. `max_batch` is the KV cache's
    slot count (`kv_cache.kv_cache_slots` sizes it from the device's memory).

    A decode step reads one thing back from the device: the chosen tokens (with the count of
    misrouted rows in the same copy). `cuda_graphs` (default: on CUDA) replays one CUDA graph per
    batch bucket (rollout/decode_step.py), captured before the first decode step that can use it
    (`capture_graphs` captures at once); `pad_to_buckets` runs the graphs' padded path eagerly.
    `attention`: "auto" (the Triton decode kernel where it runs, else torch), "triton" or "torch".

    `kv`: "slots" (rollout/kv_cache.py) or "paged" (rollout/paged_kv.py: `kv_pages` pages of
    `page_size` positions, default as many bytes as the slots; GRPO group prefix sharing; admission
    by predicted length with preemption of the newest request, recomputed later; the same decode
    kernel, with the block table, and the same CUDA graphs).
    """

    def __init__(self, model: Qwen3MoeModel, sampling: SamplingParams, max_batch: int,
                 max_len: int, eos_id: int | None = None, cuda_graphs: bool | None = None,
                 pad_to_buckets: bool = False, attention: str = "auto", kv: str = "slots",
                 kv_pages: int | None = None, page_size: int = 16, kv_reserve: float = 0.1):
        cfg = model.config
        self.model, self.sampling, self.eos_id = model, sampling, eos_id
        self.max_batch, self.device = max_batch, model.device
        self.cache = build_kv_cache(kv, cfg, max_batch, max_len, model.dtype, self.device, kv_pages, page_size,
                                    kv_reserve)
        # Prefill tokens the admitted requests asked for and those the forward computed (group
        # prefix sharing), and requests preempted when the pages ran out.
        self.prefill_requested = self.prefill_computed = self.preempted = 0
        if attention not in ("auto", "triton", "torch"):
            raise ValueError(f"attention: expected auto, triton or torch, got {attention!r}")
        if attention != "torch":
            from megatron_rl.rollout import decode_attention

            if decode_attention.available(self.device, cfg.kv_channels, model.dtype):
                self.cache.kernel = decode_attention.decode_attention
            elif attention == "triton":
                raise ValueError(f"the Triton decode kernel does not run here ({self.device}, "
                                 f"head dim {cfg.kv_channels})")
        graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.runner = DecodeRunner(model, self.cache, max_batch, graphs, pad_to_buckets)
        # Rows routed to an expert their rank does not hold, counted by every layer's bank on the
        # device; read with the step's tokens.
        self._misrouted = torch.zeros(1, dtype=torch.long, device=self.device)
        # Each response's uniform draws, one row per KV slot, made when it is admitted (sampling only).
        self._draws = None if sampling.greedy else \
            torch.zeros(max_batch + 1, max_len, dtype=torch.float64, device=self.device)
        self._drawn: dict[int, tuple[str, int]] = {}  # slot -> the response whose draws it holds
        self.pending: list[Request] = []
        self.live: list[Request] = []
        self.finished: list[Request] = []

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

    def add(self, requests: list[Request]) -> None:
        for r in requests:
            need = len(r.prompt) + (r.fixed_len if r.fixed_len is not None else r.max_new_tokens)
            if need > self.cache.capacity:
                raise ValueError(f"request {r.key} needs {need} positions, the KV cache has {self.cache.capacity}")
        self.pending.extend(requests)

    def has_work(self) -> bool:
        return bool(self.pending or self.live)

    @property
    def load(self) -> int:
        """Requests on this rank not yet finished (what the drain check counts)."""
        return len(self.pending) + len(self.live)

    @torch.inference_mode()
    def step(self) -> int:
        """One forward; returns the number of tokens generated."""
        self._share_counter()
        admit = self._admissible() if self.pending else 0
        if admit:
            return self._prefill(admit)
        if self.live:
            return self._decode()
        self.dummy_step()
        return 0

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """Join every MoE layer's collectives with zero tokens."""
        empty = torch.zeros(0, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
        for moe in self.model.moe_layers:
            moe(empty)

    def _share_counter(self) -> None:
        for moe in self.model.moe_layers:
            if isinstance(moe, MoELayer) and moe.experts.misrouted is not self._misrouted:
                moe.experts.misrouted = self._misrouted

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _read_back(self, t: torch.Tensor) -> list[int]:
        """`t`'s values on the host. On CUDA through a pinned buffer and an event: the wait is for
        this copy alone, not a stream or device synchronisation (`set_sync_debug_mode` passes)."""
        if self.device.type == "cpu":
            return t.tolist()
        if getattr(self, "_host_out", None) is None or self._host_out.numel() < t.numel():
            # A step's tokens, as many values riding with them, and the misrouted count.
            self._host_out = torch.empty(2 * self.max_batch + 1, dtype=t.dtype, pin_memory=True)
            self._copied = torch.cuda.Event()
        out = self._host_out[: t.numel()]
        out.copy_(t, non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        return out.tolist()

    def _fill_draws(self, batch: list[Request]) -> None:
        """Admission: the draws of every step a response may take, into its slot's row (a
        migrated request gets its row at its first step here)."""
        for r in batch:
            if self._drawn.get(r.slot) != r.key:
                n = r.fixed_len if r.fixed_len is not None else r.max_new_tokens
                u = draws(self.sampling, r.key, range(len(r.tokens), n))
                self._draws[r.slot, len(r.tokens):n] = self._to_device(torch.tensor(u, dtype=torch.float64))
                self._drawn[r.slot] = r.key

    def _admissible(self) -> int:
        """How many pending requests the cache admits now (a free slot each; paged: their predicted pages)."""
        head = self.pending[: len(self.cache.free)]  # one free sequence (slot) each at most
        seqs = [tuple(r.prompt + r.tokens) for r in head]
        # Positions a request would share with an earlier one admitted with it (its group's prompt).
        seen, shared = set(), []
        for ids in seqs:
            shared.append(len(ids) if ids in seen else 0)
            seen.add(ids)
        return self.cache.admissible([len(ids) for ids in seqs], [r.predicted_positions() for r in head],
                                     len(self.live), shared)

    def _prefill(self, n: int) -> int:
        admit = self.pending[:n]
        self.pending = self.pending[n:]
        # A preempted request recomputes the keys of its tokens so far.
        seqs = [r.prompt + r.tokens for r in admit]
        lens = [len(ids) for ids in seqs]
        S = max(lens)
        # Rows the forward computes: one per distinct sequence where the cache shares prefixes
        # (a GRPO group's samples), else every row; src[b] is row b's computed row.
        rows, src, first = [], [], {}
        for b, ids in enumerate(seqs):
            key = tuple(ids) if self.cache.shares_prefix else b
            if key not in first:
                first[key] = len(rows)
                rows.append(b)
            src.append(first[key])
        # Token ids, then each row's length, slot and tokens so far: one host buffer, one copy.
        host = torch.zeros(len(admit), S + 3, dtype=torch.long)
        for b, r in enumerate(admit):
            r.slot = self.cache.alloc(r.predicted_positions())
            host[b, : lens[b]] = torch.tensor(seqs[b], dtype=torch.long)
            host[b, S:] = torch.tensor([lens[b], r.slot, len(r.tokens)])
        dev = self._to_device(host)
        shared = len(rows) < len(admit)
        comp = dev[self._to_device(torch.tensor(rows))] if shared else dev
        ids_BS, lens_B = comp[:, :S], comp[:, S]
        mask_BS = torch.arange(S, device=self.device)[None] < lens_B[:, None]
        pos_BS = self.cache.prefill([admit[b].slot for b in rows], [lens[b] for b in rows])
        logits_BV = self.model(ids_BS, pos_BS, self.cache, mask_BS, logits_at_B=lens_B - 1)
        self.cache.commit()
        if shared:
            for b, u in enumerate(src):
                if rows[u] != b:
                    self.cache.fork(admit[rows[u]].slot, admit[b].slot)
                    self._forked(admit[rows[u]].slot, admit[b].slot, lens[b])
            logits_BV = logits_BV[self._to_device(torch.tensor(src))]
        self.prefill_requested += sum(lens)
        self.prefill_computed += sum(lens[b] for b in rows)
        self.live.extend(admit)
        if self._draws is not None:
            self._fill_draws(admit)
        self._rows = (dev[:, S + 1], dev[:, S + 2])
        return self._emit(admit, logits_BV)

    def _preempt(self, r: Request) -> None:
        """Pool exhausted: `r` gives its pages back and waits first in line; admitted again, it
        recomputes its keys (prompt and tokens so far) and continues. Nothing is dropped."""
        self.live.remove(r)
        self.cache.release(r.slot)
        r.slot = -1
        self.pending.insert(0, r)
        self.preempted += 1

    def kv_report(self) -> dict:
        """The KV cache's figures for the rollout report (summed over ranks by the runner)."""
        c = self.cache
        return {"prefill_tokens_requested": self.prefill_requested, "prefill_tokens_computed": self.prefill_computed,
                "pages_shared": getattr(c, "pages_shared", 0), "preemptions": self.preempted,
                "kv_bytes": c.nbytes if c.k else 0}

    def _decode(self) -> int:
        # Paged: a page for every row whose next position starts one, preempting the newest
        # request while the pool has too few (the last one left always fits: `add` checked).
        while not self.cache.grow([r.slot for r in self.live]):
            self._preempt(self.live[-1])
        batch = self.live
        if self._draws is not None:
            self._fill_draws(batch)
        slots = [r.slot for r in batch]
        lengths = self.cache.lengths
        logits_BV = self.runner.step([r.tokens[-1] for r in batch], slots, [lengths[s] for s in slots],
                                     [len(r.tokens) for r in batch])
        for s in slots:
            lengths[s] += 1
        if self._draws is not None:  # each row's draw: its slot's row, at its count of tokens
            self._rows = (self.runner.inputs[: len(batch), 1], self.runner.inputs[: len(batch), 3])
        return self._emit(batch, logits_BV)

    def _emit(self, batch: list[Request], logits_BV: torch.Tensor) -> int:
        toks_B = choose_tokens(logits_BV, self.sampling, None if self._draws is None else self._draws[self._rows])
        rides_R = self._rides_with_tokens(logits_BV, toks_B)
        # The step's one read of device data: the tokens, what a subclass records of them, and the
        # misrouted count, in one copy.
        *values, misrouted = self._read_back(torch.cat([toks_B, rides_R, self._misrouted]))
        if misrouted:
            next(m for m in self.model.moe_layers if isinstance(m, MoELayer)).experts.check_routing()
        toks = values[: len(batch)]
        self._record(batch, values[len(batch):])
        for r, t in zip(batch, toks):
            r.tokens.append(t)
        still = []
        for r in self.live:
            if r.done(self.eos_id):
                self.cache.release(r.slot)
                self.finished.append(r)
            else:
                still.append(r)
        self.live = still
        return len(batch)

    def _forked(self, src: int, dst: int, positions: int) -> None:
        """Slot `dst` took `src`'s first `positions` keys without computing them (a shared prefix):
        a subclass copies what it recorded of them."""

    def _rides_with_tokens(self, logits_BV: torch.Tensor, toks_B: torch.Tensor) -> torch.Tensor:
        """int64 values a subclass computes on the device from the step's logits and chosen tokens;
        they come back in the tokens' copy and reach `_record`, so recording adds no host read."""
        return toks_B[:0]

    def _record(self, batch: list[Request], values: list[int]) -> None:
        """The host values of `_rides_with_tokens`, before `batch` gets its new tokens."""
