"""KV admission: when each request of a rank starts decoding, under a slot or a paged KV budget and
a cap on the requests a rank decodes at once.

The simulator's default (`tokens`) starts every request of a rank at the prefill and prices its KV
at its real tokens: the planner's KV-safe placement already keeps their sum within the rank's budget
(docs/planner.md). A real engine holds the KV in a cache of a fixed size and admits a request only
when its share fits (megatron_rl/rollout/kv/slots.py, paged.py):
- `slots`: every request holds a slot of the longest sequence, `kv_unit.slot_len` positions, whatever its
  length; a rank runs `budget // slot_len` requests at once.
- `paged`: a request holds pages of `page_size` positions for its real length (prompt + response,
  rounded up to whole pages), reserved at admission. The engine reserves by the predicted length
  and preempts when a prediction falls short; the simulator reserves the true length, so no
  request is ever preempted here. The samples of one GRPO group that a rank admits at the same
  step share their prompt's full pages, as the engine's prefill does (engine.py `_prefill`,
  paged.py `fork`): the first holds all its pages, each other only its pages beyond the shared
  ones, and the shared pages return to the budget when the last of those sharers ends (the
  engine's refcounted pages). A sample admitted at a later step than its group's first shares
  nothing: it prefills its own pages. The groups are `kv_unit.share_groups`.
What a request holds is `KVUnit.held`, what it shares `KVUnit.shared` (elastic/planning/memory/kv_unit.py),
the planner's rules as well.

A rank of the engine also decodes at most `max_batch` requests at once (its KV slots,
`RolloutConfig.max_batch_per_rank`), whatever its cache: with a cap (`SimConfig.max_batch`) a request
also waits for one of them to end. Under `tokens` the cap is all that binds: its budget is the
rank's whole batch.

Requests are admitted in batch order (first come, first served), each as soon as the requests
before it are admitted, its positions fit beside those still decoding and fewer than `max_batch`
decode (the engine's `_admissible`: one request per free slot); a request admitted when
another ends at decode step s decodes steps s + 1 .. s + its length. Its prefill rides on that step
(its first token is emitted by the prefill, as at tick 0), so a late prefill adds no time: the
admitted requests' effect is fewer requests per step and more steps.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence

import numpy as np

from elastic.planning.memory.kv_unit import KVUnit, slot_len
from elastic.planning.shape import ModelShape


def start_steps(unit: KVUnit, shape: ModelShape, owned: np.ndarray, rank: np.ndarray,
                prompt: np.ndarray, tokens: np.ndarray, length: np.ndarray, group: Sequence[Hashable],
                max_batch: int | None = None) -> np.ndarray:
    """The decode step after which each request starts (0: at the prefill), `length` being its
    decode steps, under the cache `unit` and at most `max_batch` requests at once (None: no cap);
    `group` is each request's sharing group (`kv_unit.share_groups`). Under `slots` or `paged` each
    rank's budget is what its memory leaves for KV beside the `owned[rank]` experts it holds at
    stage 0 (the engine sizes its cache once); under `tokens` there is none (`KVUnit.queues`)."""
    prompt = np.asarray(prompt, np.int64)
    held = unit.held(prompt, np.asarray(tokens, np.int64), int(slot_len(prompt, np.max(tokens))))
    budget = {r: shape.kv_budget_bytes(int(owned[r])) // shape.kv_bytes_per_token
              for r in range(len(owned))} if unit.queues else None
    return admit(rank, length, held, budget, group, unit.shared(prompt), max_batch)


def admit(rank: np.ndarray, length: np.ndarray, held: np.ndarray, budget: dict[int, int] | None,
          group: Sequence[Hashable] | None = None, shared: np.ndarray | None = None,
          max_batch: int | None = None) -> np.ndarray:
    """The decode step after which each request starts, first come first served: `held` is its KV
    positions, `budget` each rank's (None: no budget binds, only `max_batch`); `shared` (None: none)
    the positions of `held` that the requests of its `group` admitted with it on its rank hold once;
    `max_batch` the most requests a rank decodes at once (None: no cap). A request that alone
    exceeds its rank's budget can never run: ValueError naming it."""
    start = np.zeros(len(rank), dtype=np.int64)
    for r in np.unique(rank):
        mine = np.flatnonzero(rank == r)
        room = int(budget[int(r)]) if budget is not None else int(held[mine].sum())
        if held[mine].max() > room:
            i = mine[int(np.argmax(held[mine]))]
            raise ValueError(f"kv: request {int(i)} holds {int(held[i])} KV positions, more than rank {int(r)}'s "
                             f"budget of {room}")
        cache = _RankCache(room, max_batch)
        for i in mine:
            g, common = (None, 0) if shared is None or not shared[i] else (group[i], int(shared[i]))
            while not cache.fits(int(held[i]), g, common):
                cache.wait()
            start[i] = cache.now
            cache.take(int(held[i]), g, common, cache.now + int(length[i]))
    return start


class _RankCache:
    """One rank's KV positions as its requests are admitted: the requests decoding, and the prompt
    pages shared by the samples of one group admitted at the same step (refcounted, as the engine's
    pool: they return with the last of their holders), and the cap on how many decode at once."""

    def __init__(self, room: int, max_batch: int | None = None):
        self.room, self.now, self.max_batch = room, 0, max_batch
        self.live: list[tuple[int, int, int]] = []  # (end step, own positions, sharing or -1) decoding
        self.sharings: dict[int, list] = {}  # sharing -> [holders, positions, group]
        self.opened: dict[Hashable, int] = {}  # group -> its sharing opened at step `now`
        self._ids = itertools.count()

    def need(self, held: int, group: Hashable | None, common: int) -> int:
        """Positions a request of `held` takes now: those beyond `common` where its group's sharing
        of this step is open."""
        return held - common if group in self.opened else held

    def fits(self, held: int, group: Hashable | None, common: int) -> bool:
        """Whether a request of `held` (`need`) is admitted now: its positions fit and a slot is free."""
        free = self.max_batch is None or len(self.live) < self.max_batch
        return free and self.room >= self.need(held, group, common)

    def wait(self) -> None:
        """Until the next request ends: its own positions, and its sharing's once it held it last."""
        end, pos, s = heapq.heappop(self.live)
        if end > self.now:  # a later prefill: nothing admitted from now on shares with earlier ones
            self.now, self.opened = end, {}
        self.room += pos
        if s >= 0:
            sharing = self.sharings[s]
            sharing[0] -= 1
            if not sharing[0]:  # its last holder: the shared pages return
                self.room += sharing[1]
                del self.sharings[s]
                if self.opened.get(sharing[2]) == s:
                    del self.opened[sharing[2]]

    def take(self, held: int, group: Hashable | None, common: int, end: int) -> None:
        """Admit a request of `held` positions until step `end`, `common` of them shared with its
        group's requests admitted now (`group` None: `common` is 0, it shares nothing)."""
        s = -1
        if group is not None:
            if group not in self.opened:  # the first of its group this step: it brings the shared pages
                self.opened[group] = next(self._ids)
                self.sharings[self.opened[group]] = [0, common, group]
                self.room -= common
            s = self.opened[group]
            self.sharings[s][0] += 1
        self.room -= held - common
        heapq.heappush(self.live, (end, held - common, s))


def peak_concurrent(live: np.ndarray) -> list[int]:
    """Each rank's most requests decoding at once (`live`: ranks x steps)."""
    return [int(x) for x in live[:, 1:].max(axis=1)] if live.shape[1] > 1 else [0] * len(live)
