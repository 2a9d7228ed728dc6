"""KV admission: when each request of a rank starts decoding, under a slot or a paged KV budget.

The simulator's default (`tokens`) starts every request of a rank at the prefill and prices its KV
at its real tokens: the planner's KV-safe placement already keeps their sum within the rank's budget
(docs/planner.md). A real engine holds the KV in a cache of a fixed size and admits a request only
when its share fits (megatron_rl/rollout/kv_cache.py, paged_kv.py):
- `slots`: every request holds a slot of the longest sequence, `kv_unit.slot_len` positions, whatever its
  length; a rank runs `budget // slot_len` requests at once.
- `paged`: a request holds pages of `page_size` positions for its real length (prompt + response,
  rounded up to whole pages), reserved at admission. The engine reserves by the predicted length
  and preempts when a prediction falls short; the simulator reserves the true length, so no
  request is ever preempted here. Nor does it share a group's prompt pages: a request's pages are
  its own (the planner's `kv.Demand` counts the sharing).
What a request holds is `KVUnit.held` (elastic/planning/kv_unit.py), the planner's rule as well.

Requests are admitted in batch order (first come, first served), each as soon as the requests
before it are admitted and its positions fit beside those still decoding; a request admitted when
another ends at decode step s decodes steps s + 1 .. s + its length. Its prefill rides on that step
(its first token is emitted by the prefill, as at tick 0), so a late prefill adds no time: the
admitted requests' effect is fewer requests per step and more steps.
"""
from __future__ import annotations

import heapq

import numpy as np

from elastic.planning.kv_unit import KVUnit, slot_len
from elastic.planning.shape import ModelShape


def start_steps(unit: KVUnit, shape: ModelShape, owned: np.ndarray, rank: np.ndarray,
                prompt: np.ndarray, tokens: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The decode step after which each request starts (0: at the prefill), `length` being its
    decode steps, under a `slots` or `paged` cache (`unit`). Each rank's budget is what its memory
    leaves for KV beside the `owned[rank]` experts it holds at stage 0 (the engine sizes its cache
    once)."""
    held = unit.held(np.asarray(prompt, np.int64), np.asarray(tokens, np.int64), int(slot_len(prompt, np.max(tokens))))
    budget = {r: shape.kv_budget_bytes(int(owned[r])) // shape.kv_bytes_per_token for r in range(len(owned))}
    return admit(rank, length, held, budget)


def admit(rank: np.ndarray, length: np.ndarray, held: np.ndarray, budget: dict[int, int]) -> np.ndarray:
    """The decode step after which each request starts, first come first served: `held` is its KV
    positions, `budget` each rank's. A request that alone exceeds its rank's budget can never run:
    ValueError naming it."""
    start = np.zeros(len(rank), dtype=np.int64)
    for r in np.unique(rank):
        mine = np.flatnonzero(rank == r)
        room = int(budget[int(r)])
        if held[mine].max() > room:
            i = mine[int(np.argmax(held[mine]))]
            raise ValueError(f"kv: request {int(i)} holds {int(held[i])} KV positions, more than rank {int(r)}'s "
                             f"budget of {room}")
        live: list[tuple[int, int]] = []  # (end step, positions) of the requests decoding
        now = 0
        for i in mine:
            while room < held[i]:  # wait for the next end
                end, pos = heapq.heappop(live)
                now, room = max(now, end), room + pos
            start[i] = now
            room -= int(held[i])
            heapq.heappush(live, (now + int(length[i]), int(held[i])))
    return start


def peak_concurrent(live: np.ndarray) -> list[int]:
    """Each rank's most requests decoding at once (`live`: ranks x steps)."""
    return [int(x) for x in live[:, 1:].max(axis=1)] if live.shape[1] > 1 else [0] * len(live)
