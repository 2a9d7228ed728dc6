"""The sampled future one online decision is priced on (`online.rule.OnlineRule`).

The remaining lengths of the live requests are sampled jointly (`remaining.OnlineModel`); `Grid` cuts
the remaining decode steps into segments (geometric from one step, so the early decisions are
resolved, plus the delays a later shrink is priced at) and counts, per sample, segment and rank,
the requests still alive and the KV they hold, for any placement of the requests.
"""
from __future__ import annotations

import numpy as np

# Grid of future steps a scenario is priced on: geometric, so the early decisions are resolved.
PIECES = 24

class Grid:
    """The sampled future of one decision: segments of remaining decode steps (geometric, plus
    the delays a later shrink is priced at), and the live requests alive in each."""

    def __init__(self, rem: np.ndarray, held: np.ndarray, ranks: np.ndarray, world: int, check_every: int):
        self.rem, self.held, self.ranks, self.world = rem, held, np.asarray(ranks), world
        end = rem.max(axis=1)
        self.delays = [check_every * 2**m for m in range(64) if check_every * 2**m < end.max()]
        self.bounds = np.unique(np.concatenate([[0.0], np.geomspace(1.0, max(end.max(), 2.0), PIECES),
                                                np.array(self.delays, float)]))
        self.seg = np.clip(np.minimum(self.bounds[1:][None, :], end[:, None]) - self.bounds[:-1][None, :], 0.0, None)
        self.mid = (self.bounds[:-1] + self.bounds[1:]) / 2
        self.by_rem = np.argsort(rem, axis=1, kind="stable")  # each sample's requests, shortest first
        self.span = float(rem.max()) + 1.0 if rem.size else 1.0
        self.memo: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}  # a decision asks for a layout twice

    def per_rank(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(S, K, world) live requests and their KV tokens per rank, with request c on ranks[c].

        Per sample, the requests sorted by rank and, within a rank, by remainder: those alive at
        a segment's middle are a suffix of their rank's run, found by one binary search per
        (rank, segment) on the key rank * span + remainder (whole numbers below 2**53: exact)."""
        ranks = np.asarray(ranks, dtype=np.int64)
        key = ranks.tobytes()
        if key not in self.memo:
            self.memo[key] = self._per_rank(ranks)
        return self.memo[key]

    def _per_rank(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        S, K = self.seg.shape
        W = self.world
        per = np.bincount(ranks, minlength=W)
        ends = np.cumsum(per)
        query = np.arange(W)[:, None] * self.span + self.mid[None, :]  # (W, K)
        count = np.empty((S, K, W))
        kv = np.empty((S, K, W))
        for s in range(S):
            o = self.by_rem[s][np.argsort(ranks[self.by_rem[s]], kind="stable")]
            pos = np.searchsorted(ranks[o] * self.span + self.rem[s, o], query, side="right")
            csum = np.concatenate([[0.0], np.cumsum(self.held[o])])
            count[s] = (ends[:, None] - pos).T
            kv[s] = (csum[ends][:, None] - csum[pos]).T
        return count, kv + count * self.mid[None, :, None]


def batch_context(batch: np.ndarray, kv_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S, K) batch and KV tokens of the member that sets each step -> the mean batch and context."""
    b = np.maximum(batch.mean(axis=0), 1.0)
    return b, kv_tokens.mean(axis=0) / b
