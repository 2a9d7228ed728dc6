"""What a rollout records of its routes, per request (models/routes.py says what a route is).

While a request is live its routes are rows of the engine's `RouteSink` (its KV slot's rows,
written on the device by every MoE layer). A request may start with routes recorded elsewhere,
its *prefix*: a partial rollout's carried response (the routes of its tokens so far, from the
steps that sampled them) or a migrated request (the sender's rows). Its routes are then the prefix,
followed by the slot's rows from the prefix's end: a carried response is re-prefilled under the new
weights, but its carried tokens keep the routes they were sampled with.

When a request finishes, its slot's rows are copied on the device before the slot is reused; the
host reads every response's routes once, with the rollout's results (`routes`). The migrating
engine moves a request's routes with its log-probs (`CarriedValues`).
"""
from __future__ import annotations

import torch

from megatron_rl.models.routes import RouteRows, RouteSink, RouteWrite, recording


def read_positions(r) -> int:
    """Positions a request's forwards have read: its prompt and every token but the last."""
    return len(r.prompt) + len(r.tokens) - 1 if r.tokens else 0  # no token yet: not prefilled


class RouteRecorder:
    def __init__(self, model, cache):
        cfg = model.config
        self.model, self.cache = model, cache
        self.shape = (cfg.num_layers, cfg.moe_router_topk)
        self.sink = RouteSink(cache, cfg.num_layers, cfg.moe_router_topk, cfg.num_moe_experts)
        self.prefix: dict[tuple[str, int], torch.Tensor] = {}  # host [P, L, K]
        self.kept: dict[tuple[str, int], torch.Tensor] = {}  # device rows of finished requests

    def start(self, prefix: dict[tuple[str, int], torch.Tensor]) -> None:
        """A rollout begins: the requests' routes recorded before it (by key)."""
        self.prefix, self.kept = dict(prefix), {}

    def recording(self, rows: RouteRows):
        """Every MoE layer writes into the sink at `rows`, one engine forward's (its batch's), inside
        the block."""
        return recording(self.model, RouteWrite(self.sink, rows))

    def _slot_rows(self, r) -> torch.Tensor:
        start = len(self.prefix.get(r.key, ()))
        end = read_positions(r)
        if r.slot < 0 or end <= start:
            return self.sink.buf_RLK.new_zeros(0, *self.shape)
        return self.sink.rows_of(r.slot, start, end)

    def keep(self, r) -> None:
        """`r` finished in this step: its slot's rows, before the slot is reused."""
        self.kept[r.key] = self._slot_rows(r)

    def routes_of(self, r) -> torch.Tensor:
        """Host routes of a live or pending request so far (a migration reads them)."""
        rows = self._slot_rows(r).cpu()
        pre = self.prefix.get(r.key)
        return rows if pre is None else torch.cat([pre, rows.to(pre.dtype)])

    def routes(self, requests_live: list) -> dict[tuple[str, int], torch.Tensor]:
        """Every request's routes on the host (finished ones and `requests_live`), in one read."""
        for r in requests_live:
            self.kept[r.key] = self._slot_rows(r)
        keys = list(self.kept)
        if not keys:
            return {}
        flat = torch.cat([self.kept[k] for k in keys]).cpu()
        out = {}
        for k, part in zip(keys, flat.split([len(self.kept[k]) for k in keys])):
            pre = self.prefix.get(k)
            out[k] = part if pre is None else torch.cat([pre, part])
        return out


class CarriedValues:
    """What moves with a migrated request besides its tokens and KV (`MigratingRolloutEngine`'s
    `carried`, a key -> list of floats mapping): its sampling log-probs, then its routes so far
    (expert ids are small integers, exact in float64): [n log-probs, log-probs..., route ids...]."""

    def __init__(self, engine):
        self.engine = engine

    def get(self, key, default=None):
        e = self.engine
        lps = e.logprobs.get(key, [])
        r = next((r for r in e.live + e.pending if r.key == key), None)
        ids = [] if r is None else e.recorder.routes_of(r).reshape(-1).tolist()
        return [float(len(lps)), *lps, *map(float, ids)]

    def __setitem__(self, key, values: list[float]) -> None:
        e = self.engine
        n = int(values[0])
        e.logprobs[key] = list(values[1:1 + n])
        ids = torch.tensor(values[1 + n:], dtype=torch.float64)
        e.recorder.prefix[key] = ids.to(e.recorder.sink.buf_RLK.dtype).view(-1, *e.recorder.shape)

    def pop(self, key, default=None):
        self.engine.recorder.prefix.pop(key, None)
        return self.engine.logprobs.pop(key, default)
