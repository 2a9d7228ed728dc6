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
    the delays a later shrink is priced at), and the live requests alive in each. `rem` (samples x
    live requests) holds whole numbers of steps, as `OnlineModel.sample_remaining` draws them."""

    def __init__(self, rem: np.ndarray, held: np.ndarray, ranks: np.ndarray, world: int, check_every: int):
        self.rem, self.held, self.ranks, self.world = rem, held, np.asarray(ranks), world
        end = rem.max(axis=1)
        last = float(end.max())
        self.delays = [check_every * 2**m for m in range(64) if check_every * 2**m < last]
        bounds = np.sort(np.concatenate([[0.0], np.geomspace(1.0, max(last, 2.0), PIECES),
                                         np.array(self.delays, float)]))
        self.bounds = bounds[np.concatenate([[True], bounds[1:] != bounds[:-1]])]  # np.unique's, without its overhead
        self.seg = np.clip(np.minimum(self.bounds[1:][None, :], end[:, None]) - self.bounds[:-1][None, :], 0.0, None)
        self.mid = (self.bounds[:-1] + self.bounds[1:]) / 2
        self.by_rem = np.argsort(rem, axis=1, kind="stable")  # each sample's requests, shortest first
        self.span = float(rem.max()) + 1.0 if rem.size else 1.0
        self.memo: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}  # a decision asks for a layout twice
        # What every layout's search shares (`_per_rank`): each sample's row, its keys' shift, and
        # the queries rank * span + a segment's middle as the whole numbers a key is compared with.
        S, n = rem.shape
        self.rows = np.arange(S)[:, None]
        self.shift = self.rows * (int(self.span) * (world + 1))
        self.rem_steps = rem.astype(np.int64)
        query = np.arange(world)[:, None] * self.span + self.mid[None, :]  # (W, K)
        self.queries = np.floor(query).astype(np.int64).ravel()[None, :] + self.shift  # (S, W * K)

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
        W, n, rows = self.world, len(ranks), self.rows
        ends = np.cumsum(np.bincount(ranks, minlength=W))
        # Every sample's requests by rank, then by remainder (`by_rem`'s order), as one (S, n) array.
        o = self.by_rem[rows, np.argsort(ranks[self.by_rem], axis=1, kind="stable")]
        # One search for every sample: a whole-number key is at most a query exactly when it is at
        # most the query's floor, so keys and floors compare as integers, each sample's shifted past
        # the one before (its keys and queries stay below W * span).
        key = ranks[o] * int(self.span) + self.rem_steps[rows, o] + self.shift
        pos = (np.searchsorted(key.ravel(), self.queries, side="right") - rows * n).reshape(S, W, K)
        csum = np.zeros((S, n + 1))
        np.cumsum(self.held[o], axis=1, out=csum[:, 1:])
        count = (ends[None, :, None] - pos).transpose(0, 2, 1).astype(float)
        kv = csum[:, ends][:, :, None] - csum[rows, pos.reshape(S, -1)].reshape(S, W, K)
        return count, kv.transpose(0, 2, 1) + count * self.mid[None, :, None]


def batch_context(batch: np.ndarray, kv_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S, K) batch and KV tokens of the member that sets each step -> the mean batch and context."""
    b = np.maximum(batch.mean(axis=0), 1.0)
    return b, kv_tokens.mean(axis=0) / b
