"""The decode step through static buffers: batch buckets, CUDA graphs, one host read per step.

A decode step's inputs are four int64 fields per request (token id, KV slot, position, tokens so
far) written into one host buffer (pinned on CUDA) and copied to the device without blocking; the
step's batch (the cache's `decode_batch`: rollout/kv/batch.py) views them, and the positions, the
attention mask and the MoE routing are derived from them on the device. The only read back is the
chosen tokens (with the device-side count of misrouted rows, in the same copy: `HostReadback`).
How the step runs is decided once per engine (`DecodeOptions`).

Buckets (nano-vllm's `capture_cudagraph`): the batch is padded up to 1, 2, 4, 8, then a multiple
of 16 (up to `max_batch`). A padding row decodes in the KV cache's scratch slot at position 0 and
reaches no expert (the null expert, models/moe.py), so no real row's numbers change. On CUDA, with
every MoE layer local (`LocalDispatcher`: an expert-parallel all-to-all needs its split sizes on the
host), one graph per bucket is captured into one memory pool and replayed; the same static-buffer
path runs eagerly elsewhere (CPU, expert parallel, the megatron backend), unpadded unless asked.

A graph holds the addresses of what it read: the KV tensors, each bank's stacked expert weights
and routing table, the routers' fp32 copies, the RoPE tables. Weight writes refresh those copies in
place before each replay; a new allocation (KV release and reclaim, an expert added or dropped, a
new dispatcher, a router weight moved, a RoPE table evicted from its cache and rebuilt) changes
`_key()` and the graphs are captured again before the next replay. The runner keeps the tensors it
keys on referenced, so none is freed under a live graph (tools/capture_safety.py checks that the
key changes exactly when the addresses a graph reads do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch

from megatron_rl.models.moe import LocalDispatcher, MoELayer, widens
from megatron_rl.models.qwen3_moe import rope_tables
from megatron_rl.rollout.kv.batch import DecodeBatch
from megatron_rl.rollout.kv.cache import KVCache


@dataclass(frozen=True)
class DecodeOptions:
    """How an engine's decode steps run, decided when it is built."""

    graphs: bool | None = None  # a CUDA graph per batch bucket (CUDA only); None: on CUDA
    pad: bool = False  # pad to the buckets when running eagerly (what the graphs compute, on CPU for tests)
    attention: Literal["auto", "triton", "torch"] = "auto"  # rollout/kv/attention.py `decode_kernel`


AUTO_DECODE = DecodeOptions()  # graphs on CUDA, the Triton kernel where it runs


class Forward(Protocol):
    def __call__(self, batch: DecodeBatch, ids_BS: torch.Tensor, pos_BS: torch.Tensor,
                 mask_BS: torch.Tensor | None) -> torch.Tensor:
        """One rollout forward of the model through the KV cache as `batch` says: logits [B, S, V]
        (the engine's `_forward`)."""


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied through pinned memory without blocking on CUDA."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class HostReadback:
    """The values of a step's device tensor on the host: on CUDA through a pinned buffer of
    `size` values and an event, so the wait is for this copy alone, not a stream or device
    synchronisation (`set_sync_debug_mode` passes)."""

    def __init__(self, device: torch.device, size: int):
        cuda = device.type == "cuda"
        self._host = torch.empty(size, dtype=torch.long, pin_memory=True) if cuda else None
        self._copied = torch.cuda.Event() if cuda else None

    def read(self, t: torch.Tensor) -> list[int]:
        if self._host is None:
            return t.tolist()
        out = self._host[: t.numel()]
        out.copy_(t, non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        return out.tolist()


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to (and covering) `max_batch`."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return out + [max_batch]


class DecodeRunner:
    """The decode steps of `model` over `cache`, as `options` say, each forward through `forward`."""

    def __init__(self, model, cache: KVCache, forward: Forward, options: DecodeOptions):
        self.model, self.cache, self.device, self.forward = model, cache, cache.device, forward
        graphs = self.device.type == "cuda" if options.graphs is None else options.graphs
        self.graphs_wanted = graphs and self.device.type == "cuda"
        self.pad = options.pad or self.graphs_wanted
        self.buckets = batch_buckets(cache.slots)
        n_max = self.buckets[-1]
        pinned = self.device.type == "cuda"
        # [row, field]: a batch's rows are one contiguous block (a strided pinned slice would be
        # staged through pageable memory, which blocks).
        self._host = torch.zeros(n_max, 4, dtype=torch.long, pin_memory=pinned)
        # The same memory as a numpy array, taken once: a step writes its rows through it
        # (`torch.tensor` of the nested lists cost about 0.12 ms a step at batch 64 on CPU).
        self._host_np = self._host.numpy()
        self._dev = self._host if self.device.type == "cpu" else torch.zeros_like(self._host, device=self.device)
        self._logits = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_key = None
        self._kept: list[torch.Tensor] = []  # what the graphs read, alive as long as they are
        self.captures = 0  # how many times the graphs were captured (tests, the bench)
        # Rows of no request: scratch slot, position 0, no expert.
        self._pad_row = [0, cache.scratch, 0, 0]

    def bucket(self, B: int) -> int:
        return next(n for n in self.buckets if n >= B) if self.pad else B

    @property
    def inputs(self) -> torch.Tensor:
        """The device buffer [n, 4]: token id, slot, position, tokens so far (read by sampling) per row."""
        return self._dev

    def step(self, ids: list[int], slots: list[int], positions: list[int], ntok: list[int]) -> torch.Tensor:
        """Logits [B, V] of one decode step; row b appends `ids[b]` at `positions[b]` of slot `slots[b]`."""
        B = len(ids)
        n = self.bucket(B)
        pad = n - B
        graphed = self.graphs_wanted and self._graphable()
        if graphed:
            self._refresh_copies()
            if self._graph_key != self._key():
                self.capture()  # before the inputs: capturing runs padding rows through the buffers
        self._host_np[:B] = np.array((ids, slots, positions, ntok), dtype=np.int64).T
        self._host_np[B:n] = self._pad_row
        if self._dev is not self._host:
            # The previous step's copy out of this pinned buffer is done: its tokens were read back.
            self._dev[:n].copy_(self._host[:n], non_blocking=True)
        if graphed:
            self.graphs[n].replay()
            return self._logits[:B]
        first = slots[0]
        run = slice(first, first + B) if not pad and slots == list(range(first, first + B)) else None
        # The batch's longest sequence bounds the keys read (a graph has one shape: L_max, there).
        L = max(positions) + 1
        return self._forward(n, L, run, masked=pad > 0)[:B]

    def _forward(self, n: int, L: int, run: slice | None, masked: bool) -> torch.Tensor:
        ids_n, slot_n, pos_n = self._dev[:n, 0], self._dev[:n, 1], self._dev[:n, 2]
        batch = self.cache.decode_batch(slot_n, pos_n, L, run)
        # Padding rows: their position says nothing; the slot does (the scratch slot is the last).
        valid_n1 = (slot_n != self.cache.scratch)[:, None] if masked else None
        return self.forward(batch, ids_n[:, None], pos_n[:, None], valid_n1)[:, 0]

    def _moe_layers(self) -> list:
        return self.model.moe_layers

    def _graphable(self) -> bool:
        return all(isinstance(m, MoELayer) and isinstance(m.dispatcher, LocalDispatcher) for m in self._moe_layers())

    def _refresh_copies(self) -> None:
        """The in-place copies a graph reads: stacked expert weights, fp32 router weights."""
        for m in self._moe_layers():
            m.experts.stacked()
            if widens(self.model.dtype):
                m.router.weight_fp32()

    def _held(self) -> list[torch.Tensor]:
        """The lazily made tensors a graph reads: the RoPE tables, the routers' fp32 copies."""
        cfg = self.model.config
        held = list(rope_tables(cfg.kv_channels, cfg.rotary_base, self.model.dtype, self.cache.max_len, self.device))
        return held + [m.router._fp32 for m in self._moe_layers() if m.router._fp32 is not None]

    def _key(self) -> tuple:
        layers = tuple((id(m), id(m.dispatcher), m.experts.generation) for m in self._moe_layers())
        return self.cache.generation, layers, tuple(t.data_ptr() for t in self._held())

    def release(self) -> None:
        """Drop the graphs and their memory pool (a detached rank lends its memory)."""
        self.graphs.clear()
        self._logits, self._graph_key, self._kept = None, None, []

    def capture(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool (nano-vllm's order: the
        largest graph's pool serves the smaller ones). Each capture follows one eager run of the
        same step (it builds the lazily made tensors: RoPE table, stacked copies) on padding rows,
        which write only the scratch slot."""
        torch.cuda.synchronize(self.device)
        self.release()
        pool = None
        self._host.copy_(torch.tensor(self._pad_row)[None].expand_as(self._host))
        self._dev.copy_(self._host)
        for n in reversed(self.buckets):
            logits = self._forward(n, self.cache.max_len, None, masked=True)
            if self._logits is None:
                self._logits = torch.empty(self.buckets[-1], logits.shape[-1], dtype=logits.dtype, device=self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._logits[:n] = self._forward(n, self.cache.max_len, None, masked=True)
            pool = pool or graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)
        self._kept = self._held()  # alive as long as the graphs that read them
        self._graph_key = self._key()
        self.captures += 1
