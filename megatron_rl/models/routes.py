"""Rollout routing replay (R3): the experts a rollout chose, recorded, and replayed in training.

A *route* is the top-k global expert ids of one token position in one MoE layer. A response's
routes are `[P, L, K]` (P = prompt + response positions the model read: every token but the last,
L MoE layers, K = top-k), in the smallest integer dtype that holds the expert count
(`route_dtype`). Expert ids are global, so routes stay valid while experts move between ranks
(shrink, restore) and while a request moves (KV migration) or waits (partial carry-over).

One object per MoE layer's router, `RouteTap`, does every job, on both backends (the torch
`TorchRouter` calls `tap.route`; megatron-core's `TopKRouter` calls it through its `router_replay`
hook, `get_replay_topk`):
- in the rollout it writes the layer's top-k into a `RouteSink` (a device buffer per KV slot,
  `[slots x max_len, L, K]`) at the rows of the forward in flight (`recording`, one forward at a
  time): no host read; the engine reads a finished response's rows back with the rollout's results
  (rl/rollout_phase/phase.py);
- in training (`RouteReplay`) it compares the layer's own top-k with the recorded one (router
  agreement), and with `grpo.routing_replay` uses the recorded ids instead; the gate weights are
  the current router's scores gathered at those ids, so the router keeps its gradient (as R3,
  verl's router_replay_patch and megatron-core's own RouterReplay do).

Rows arrive in one of two orders: all B x S rows of a batch (the torch block masks padding to the
null expert), or only the real ones (megatron-core's block gets `h[token_mask]`); `_rows_for`
picks the matching rows of the full-order tensors by the row count.
"""
from __future__ import annotations

import base64
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds every expert id."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 1 << 15 else torch.int32


def route_bytes_per_token(num_layers: int, topk: int, num_experts: int) -> int:
    """Bytes of one token position's routes: layers x top-k x id size."""
    return num_layers * topk * route_dtype(num_experts).itemsize


def _rows_for(full: torch.Tensor, T: int, mask_T: torch.Tensor | None) -> torch.Tensor:
    """The rows of `full` (all B x S rows) a layer that got T rows sees."""
    if T == full.shape[0] or mask_T is None:
        return full[:T]
    return full[mask_T]


class RouteRows(Protocol):
    def of(self, T: int) -> torch.Tensor:
        """Where a forward's T rows go in the sink: flat (slot x max_len + position) indices
        (rollout/kv/route_rows.py)."""


class RouteSink:
    """The rollout's route buffer: one row per (KV slot, position) of the engine's KV cache,
    `[(slots + 1) x max_len, L, K]`."""

    def __init__(self, cache, layers: int, topk: int, num_experts: int):
        self.device, self.max_len = cache.device, cache.max_len
        self.shape = ((cache.slots + 1) * cache.max_len, layers, topk)
        self.dtype = route_dtype(num_experts)
        self.buf_RLK = self._zeros()

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def release_memory(self) -> int:
        """Free the buffer with the KV cache (a detached rank holds no live request); the bytes freed."""
        freed = self.buf_RLK.numel() * self.buf_RLK.element_size()
        self.buf_RLK = self.buf_RLK.new_zeros(0, *self.shape[1:])
        return freed

    def reclaim_memory(self) -> None:
        self.buf_RLK = self._zeros()

    def copy(self, src: int, dst: int, positions: int) -> None:
        """Slot `dst` continues `src`'s first `positions` (a paged cache's shared group prefix)."""
        self.buf_RLK[dst * self.max_len: dst * self.max_len + positions] = \
            self.buf_RLK[src * self.max_len: src * self.max_len + positions]

    def rows_of(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy (on the device, no host read) of slot `slot`'s positions [start, end)."""
        base = slot * self.max_len
        return self.buf_RLK[base + start: base + end].clone()


class RouteReplay:
    """A training batch's recorded routes `[B x S, L, K]` with the rows that have them (`has_T`:
    real tokens of responses whose routes were recorded), and the agreement tallies."""

    def __init__(self, routes_TLK: torch.Tensor, has_T: torch.Tensor, mask_T: torch.Tensor | None,
                 replay: bool, observe: bool):
        self.routes_TLK, self.has_T, self.mask_T = routes_TLK, has_T, mask_T
        self.replay, self.observe = replay, observe
        # token-layer pairs compared, pairs whose top-k sets agree; per row: any layer differs
        self.pairs = torch.zeros(2, dtype=torch.float64, device=routes_TLK.device)
        self.flip_T = torch.zeros(routes_TLK.shape[0], dtype=torch.bool, device=routes_TLK.device)

    def route(self, layer: int, own_TK: torch.Tensor) -> torch.Tensor:
        T = own_TK.shape[0]
        target_TK = _rows_for(self.routes_TLK[:, layer], T, self.mask_T).long()  # kept in the route dtype
        has_T = _rows_for(self.has_T, T, self.mask_T)
        if self.observe and T:
            same_T = (own_TK.sort(-1).values == target_TK.sort(-1).values).all(-1)
            self.pairs += torch.stack([has_T.sum(), (same_T & has_T).sum()]).double()
            flip = ~same_T & has_T
            if T == self.flip_T.shape[0] or self.mask_T is None:
                self.flip_T[:T] |= flip
            else:
                self.flip_T[self.mask_T] |= flip
        if not self.replay:
            return own_TK
        return torch.where(has_T[:, None], target_TK, own_TK)


@dataclass(frozen=True)
class RouteWrite:
    """One rollout forward's route recording: into `sink`, at the forward's `rows` (its batch's)."""

    sink: RouteSink
    rows: RouteRows

    def __call__(self, layer: int, expert_TK: torch.Tensor) -> None:
        T = expert_TK.shape[0]
        if T:
            buf_RLK = self.sink.buf_RLK
            buf_RLK[self.rows.of(T), layer] = expert_TK.to(buf_RLK.dtype)


class RouteTap:
    """One MoE layer's route hook (set on its router as `tap`; megatron's as `router_replay`)."""

    def __init__(self, layer: int):
        self.layer = layer
        self.write: RouteWrite | None = None
        self.replay: RouteReplay | None = None

    def route(self, scores_TE: torch.Tensor, top_TK: torch.Tensor, expert_TK: torch.Tensor):
        """The (scores, ids) the layer uses: its own top-k, recorded; or the recorded ids with the
        router's current scores at them."""
        if self.write is not None:
            self.write(self.layer, expert_TK)
        if self.replay is None:
            return top_TK, expert_TK
        used_TK = self.replay.route(self.layer, expert_TK)
        if used_TK is expert_TK:
            return top_TK, expert_TK
        return scores_TE.gather(1, used_TK), used_TK

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """megatron-core 0.16.1's `RouterReplay` hook, called by `topk_routing_with_score_function`."""
        top_TK, expert_TK = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return self.route(scores, top_TK, expert_TK)


def taps(model) -> list[RouteTap]:
    """Every MoE layer's tap, installed on its router if missing (a shrink rebuilds megatron-core's
    layers: their routers get new taps, at the same layer index)."""
    out = []
    for i, moe in enumerate(model.moe_layers):
        router = moe.router if hasattr(moe, "router") else moe.layer.router
        tap = getattr(router, "tap", None)
        if tap is None:
            tap = router.tap = RouteTap(i)
            if not hasattr(moe, "router"):  # megatron-core's TopKRouter: its replay hook
                router.router_replay = tap
        out.append(tap)
    return out


@contextmanager
def recording(model, write: RouteWrite):
    """Every MoE layer records its routes by `write` inside the block (one rollout forward; a
    shrink may rebuild megatron-core's layers between forwards, so the taps are found each time)."""
    layers = taps(model)
    for tap in layers:
        tap.write = write
    try:
        yield write
    finally:
        for tap in layers:
            tap.write = None


@contextmanager
def replaying(model, replay: RouteReplay | None):
    """Every MoE layer routes by `replay` inside the block (forward and backward)."""
    layers = taps(model)
    for tap in layers:
        tap.replay = replay
    try:
        yield replay
    finally:
        for tap in layers:
            tap.replay = None


# ---- routes as data: carried in trainer_state.json --------------------------------------------
def encode(routes_PLK: torch.Tensor) -> str:
    """A response's routes as base64 of their bytes (the shape is the reader's: P from the
    response, L and K from the model)."""
    return base64.b64encode(routes_PLK.cpu().contiguous().numpy().tobytes()).decode("ascii")


def decode(text, layers: int, topk: int, num_experts: int, where: str) -> torch.Tensor:
    """`encode`'s inverse, checked as routes: a string of whole positions, every id an expert
    (0..num_experts - 1) and the top-k ids of each token and layer distinct (a router picks k
    different experts; a repeated id would be replayed as one expert weighted twice); else
    ValueError naming `where` (the file and field) and what was expected."""
    dtype = route_dtype(num_experts)
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True) if isinstance(text, str) else None
    except ValueError:
        raw = None
    row = layers * topk * dtype.itemsize
    if raw is None or len(raw) % row:
        raise ValueError(f"{where}: expected base64 routes of whole positions ({layers} layers x {topk} ids)")
    np_dtype = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32}[dtype]
    ids = torch.from_numpy(np.frombuffer(raw, dtype=np_dtype).copy()).view(-1, layers, topk)
    if ids.numel() and (int(ids.max()) >= num_experts or int(ids.min()) < 0):
        bad = int(ids.max()) if int(ids.max()) >= num_experts else int(ids.min())
        raise ValueError(f"{where}: expert id {bad} outside 0..{num_experts - 1}")
    sorted_PLK = ids.sort(-1).values
    repeat_PL = (sorted_PLK[..., 1:] == sorted_PLK[..., :-1]).any(-1)
    if repeat_PL.any():
        position, layer = (int(i) for i in repeat_PL.nonzero()[0])
        raise ValueError(f"{where}: position {position}, layer {layer}: top-k expert ids "
                         f"{ids[position, layer].tolist()} repeat (a token's {topk} experts are distinct)")
    return ids
