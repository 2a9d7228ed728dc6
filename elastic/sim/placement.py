"""Where the simulated batch is: which rank holds each response, and, per rank and decode step, how
many of its responses are still decoding and their prompt tokens (from which the KV they hold
follows).

Apart from the simulator's rollout (`simulate._Rollout`) because this is the state a KV move
changes, and the one question a migration asks of it: can the responses a stage waits for move to
residents without breaking a KV budget. Progress is counted in decode steps, not seconds, so which
rank is live at step t does not depend on step durations, and a stretch between checks is read at once.
"""
from __future__ import annotations

import numpy as np


class Placement:
    """The responses (batch order) on `ranks` ranks; `rank[i]` holds response i."""

    def __init__(self, rank: np.ndarray, tokens: np.ndarray, prompt: np.ndarray, ranks: int,
                 start: np.ndarray | None = None):
        """`start`: the decode step after which each request is admitted (`elastic/sim/admission.py`);
        None: every one at the prefill."""
        self.rank, self.tokens, self.prompt = rank, tokens, prompt
        self.start = np.zeros(len(rank), dtype=np.int64) if start is None else start
        # Decode steps per response: the prefill emits the first token, as real engines do.
        self.length = np.maximum(self.tokens - 1, 0) + self.start
        # A request's KV at decode step t holds kv_base + t tokens (its prompt, from its start).
        self.kv_base = self.prompt - self.start
        self.steps_total = int(self.length.max()) if len(rank) else 0
        cols = self.steps_total + 2
        # live[r, t]: requests of rank r still decoding at decode step t (decode length >= t), whose
        # KV then holds kv_base + t tokens; psum: their kv_base.
        ends = np.zeros((ranks, cols), dtype=np.int64)
        pends = np.zeros((ranks, cols), dtype=np.int64)
        np.add.at(ends, (self.rank, self.length), 1)
        np.add.at(pends, (self.rank, self.length), self.kv_base)
        if start is not None:  # not yet admitted at step t: start >= t
            np.add.at(ends, (self.rank, self.start), -1)
            np.add.at(pends, (self.rank, self.start), -self.kv_base)
        self.live = np.cumsum(ends[:, ::-1], axis=1)[:, ::-1].copy()
        self.psum = np.cumsum(pends[:, ::-1], axis=1)[:, ::-1].copy()
        self.drain = np.zeros(ranks, dtype=np.int64)  # the last decode step of each rank
        self.redrain()
        self.origin = self.rank.copy()  # where each response's KV was before its latest move

    def redrain(self) -> None:
        """Each rank's last decode step, after moves."""
        self.drain[:] = 0
        np.maximum.at(self.drain, self.rank, self.length)

    def move(self, i: int, dst: int, step: int) -> None:
        """Response i continues on rank `dst` from decode step step + 1."""
        span = slice(max(step, int(self.start[i])) + 1, int(self.length[i]) + 1)
        src = int(self.rank[i])
        for arr, val in ((self.live, 1), (self.psum, int(self.kv_base[i]))):
            arr[src, span] -= val
            arr[dst, span] += val
        self.rank[i] = dst

    def few_left_step(self, ranks, few: int) -> int:
        """The decode step from which `ranks` hold at most `few` live responses in all: once the
        (few+1)-th longest of their responses has ended."""
        lens = np.sort(self.length[np.isin(self.rank, ranks)])
        return int(lens[-(few + 1)]) if len(lens) > few else 0

    def move_stragglers(self, leaving, residents: list[int], budget: dict[int, int],
                        step: int, held, max_batch: int | None = None) -> list[tuple[int, int]] | None:
        """Move the live responses of `leaving` onto `residents`, each to the one with the fewest
        live responses among those whose KV `budget` (positions) holds it over its remaining steps,
        and that decode fewer than `max_batch` (None: no cap) at every one of them; the moves, or
        None (and nothing moved) if some response has nowhere to go. `held(kv_base, t)`: the KV
        positions a request holds at decode step t under the run's cache (`KVUnit.held`: its tokens
        kv_base + t, a slot, or pages)."""
        moves = []
        for r in leaving:
            for i in np.nonzero((self.rank == r) & (self.length > step))[0]:
                moves.append(int(i))
        saved = self.live.copy(), self.psum.copy(), self.rank.copy()
        placed = []
        for i in moves:
            span = slice(step + 1, int(self.length[i]) + 1)
            ts = np.arange(span.start, span.stop)
            # Peak KV positions each resident would hold over the response's remaining steps.
            mine = held(self.kv_base[i], ts)
            peaks = np.array([(self._held_on(r, ts, held) + mine).max() for r in residents])
            fits = [r for r, p in zip(residents, peaks)
                    if p <= budget[r] and (max_batch is None or self.live[r, span].max() < max_batch)]
            if not fits:
                self.live, self.psum, self.rank = saved
                return None
            dst = min(fits, key=lambda r: (self.live[r, step + 1], r))
            self.move(i, dst, step)
            placed.append((i, dst))
        return placed

    def _held_on(self, r: int, ts: np.ndarray, held) -> np.ndarray:
        """KV positions rank r's requests hold at each decode step of `ts`, each `held(kv_base, t)`."""
        mine = np.flatnonzero(self.rank == r)
        alive = (self.start[mine, None] < ts[None, :]) & (ts[None, :] <= self.length[mine, None])
        return (alive * held(self.kv_base[mine, None], ts[None, :])).sum(axis=0)
