"""What the engine's next step runs: admission into the KV cache, preemption when its pages run
out, and the rows a prefill computes (vLLM V1's `Scheduler.schedule`, nano-vllm's scheduler.py).
The engine (engine.py) executes the step `schedule` returns and hands the tokens back (`retire`).

A step is one of:
- `Prefill`: the pending requests the cache admits now, in order (at most one per free sequence;
  the paged cache by their predicted pages), each given a sequence (`slot`). Each prefills its
  prompt and its tokens so far (a preempted or migrated request recomputes its keys). Where the
  cache shares prefixes (a GRPO group's samples, paged), the forward computes one row per distinct
  sequence and the others continue it;
- `Decode`: every live request, one token each, after a page for every row whose next position
  starts one, preempting the newest request while the pool has too few (the last one left always
  fits: `add` checked);
- None: nothing local to do (the engine's dummy step).
A prefill comes first whenever a request is admissible.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.rollout.request import Request


@dataclass(frozen=True)
class Prefill:
    requests: list[Request]  # admitted, each holding a fresh sequence (`slot`)
    seqs: list[list[int]]  # what each prefills: its prompt and tokens so far
    rows: list[int]  # the requests whose sequence the forward computes (one per distinct sequence)
    src: list[int]  # request b's computed row: an index into `rows`


@dataclass(frozen=True)
class Decode:
    requests: list[Request]  # every live request, in admission order


class Scheduler:
    """The requests of one engine: `pending` (in line, first served first), `live` (holding a
    sequence of `cache`, decoding)."""

    def __init__(self, cache):
        self.cache = cache
        self.pending: list[Request] = []
        self.live: list[Request] = []
        # Prefill tokens the admitted requests asked for and those the forward computed (group
        # prefix sharing), and requests preempted when the pages ran out.
        self.prefill_requested = self.prefill_computed = self.preempted = 0

    def add(self, requests: list[Request]) -> None:
        for r in requests:
            need = len(r.prompt) + (r.fixed_len if r.fixed_len is not None else r.max_new_tokens)
            if need > self.cache.capacity:
                raise ValueError(f"request {r.key} needs {need} positions, the KV cache has {self.cache.capacity}")
        self.pending.extend(requests)

    def schedule(self) -> Prefill | Decode | None:
        admit = self.admissible() if self.pending else 0
        if admit:
            return self._prefill(admit)
        if not self.live:
            return None
        while not self.cache.grow([r.slot for r in self.live]):
            self._preempt(self.live[-1])
        return Decode(list(self.live))

    def admissible(self) -> int:
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

    def retire(self, eos_id: int | None) -> list[Request]:
        """After a step's tokens: the live requests now done leave, their sequences freed; returned."""
        done, still = [], []
        for r in self.live:
            if r.done(eos_id):
                self.cache.release(r.slot)
                done.append(r)
            else:
                still.append(r)
        self.live = still
        return done

    def clear(self) -> None:
        """No request left: the live ones give their sequences back (a stopped rollout's)."""
        for r in self.live:
            self.cache.release(r.slot)
        self.pending, self.live = [], []

    def _prefill(self, n: int) -> Prefill:
        admit, self.pending = self.pending[:n], self.pending[n:]
        seqs = [r.prompt + r.tokens for r in admit]
        rows, src, first = [], [], {}
        for b, ids in enumerate(seqs):
            key = tuple(ids) if self.cache.shares_prefix else b
            if key not in first:
                first[key] = len(rows)
                rows.append(b)
            src.append(first[key])
        for r in admit:
            r.slot = self.cache.alloc(r.predicted_positions())
        self.prefill_requested += sum(len(ids) for ids in seqs)
        self.prefill_computed += sum(len(seqs[b]) for b in rows)
        self.live.extend(admit)
        return Prefill(admit, seqs, rows, src)

    def _preempt(self, r: Request) -> None:
        """Pool exhausted: `r` gives its pages back and waits first in line; admitted again, it
        recomputes its keys (prompt and tokens so far) and continues. Nothing is dropped."""
        self.live.remove(r)
        self.cache.release(r.slot)
        r.slot = -1
        self.pending.insert(0, r)
        self.preempted += 1
