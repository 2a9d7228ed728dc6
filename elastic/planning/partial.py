"""Partial rollouts: over-sampling, an end rule, and unfinished responses carried to the next rollout.

The synchronous rollout runs its long tail to the end (the shrink makes that tail cheap). A partial
rollout (APRIL / slime `--partial-rollout`, verl `over_sample_rate`, Kimi k1.5) instead launches
more GRPO groups than a step trains and ends early; what is unfinished is carried over and resumed
in the next rollout, under the next policy. The pieces here are pure Python, shared by the runtime
(`megatron_rl/rl/rollout_phase/partial.py`) and the simulator (`elastic/sim/partial.py`):

- `PartialRule`: how many groups a rollout launches (`target x (1 + over_sample)`, rounded up) and
  when it ends. `end="groups"`: at the first status check where `target` groups have every sample
  complete (APRIL's rule). `end="budget"`: every response decodes at most `token_budget` new tokens
  per rollout (Kimi's per-iteration budget); the rollout ends when every response has finished or
  spent its budget.
- `Carried`: one response of a pending group, with its tokens so far, the behaviour log-prob of each
  token and the policy version that sampled it (run-length `segments`; the simulator keeps counts
  only, the runtime the tokens and log-probs too).
- `CarryPool`: the pending groups between rollouts. `launch` takes its oldest groups first, then
  fresh ones; `settle` books what a rollout made and hands out up to `target` complete
  groups, oldest first. A group is trained only when all its samples are complete. `check`: every
  group launched is trained exactly once or still pending, and every response's tokens only grow.
A carried response is planned by what is left of it (`lengths.remaining.conditioned`, which
`make_plan` and the online rule read): a carried long response is a known long one, and lands on
resident ranks.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

END_RULES = ("groups", "budget")


@dataclass(frozen=True)
class PartialRule:
    over_sample: float = 0.25  # extra groups launched, as a share of the groups a step trains
    end: str = "groups"  # "groups" | "budget" (module docstring)
    token_budget: int | None = None  # `budget` only: new tokens per response per rollout

    def __post_init__(self):
        if not (self.over_sample >= 0 and math.isfinite(self.over_sample)):
            raise ValueError(f"partial.over_sample: expected a number >= 0, got {self.over_sample}")
        if self.end not in END_RULES:
            raise ValueError(f"partial.end: expected one of {', '.join(END_RULES)}, got {self.end!r}")
        if self.end == "budget" and not (self.token_budget and self.token_budget > 0):
            raise ValueError(f"partial.token_budget: end 'budget' needs a budget > 0, got {self.token_budget}")
        if self.end == "groups" and self.token_budget is not None:
            raise ValueError("partial.token_budget: only read with end 'budget'")

    def launch_count(self, target: int) -> int:
        return math.ceil(target * (1 + self.over_sample) - 1e-9)

    @property
    def describe(self) -> str:
        if self.end == "groups":
            return f"end when the step's groups are complete, over-sampling {self.over_sample:.0%}"
        return f"end at {self.token_budget} new tokens per response, over-sampling {self.over_sample:.0%}"


def groups_complete(live_per_group: np.ndarray) -> int:
    """Groups with no live sample, from the live requests counted per group of the batch."""
    return int(np.count_nonzero(np.asarray(live_per_group) == 0))


def groups_end_step(group_done_step: np.ndarray, target: int, check_every: int) -> int:
    """The `groups` rule on known lengths (the simulator): the first status check at which `target`
    groups are complete, given the decode step each group's last sample ends at (-1: none live)."""
    done = np.sort(np.asarray(group_done_step, dtype=np.int64))
    if len(done) < target or target <= 0:
        return int(done.max()) if len(done) else 0
    k = check_every
    return max(0, k * math.ceil(int(done[target - 1]) / k))


@dataclass
class Carried:
    """One response of a pending group. `segments`: (policy version, tokens) in order."""

    prompt_id: str
    sample: int  # index in its GRPO group
    prompt_len: int
    # The request's sample number in a rollout batch: unique over every group ever launched, so the
    # same prompt may be pending twice (carried from one epoch, fresh in the next) under distinct keys.
    rid: int
    n: int = 0  # tokens so far
    done: bool = False
    segments: list[tuple[int, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the runtime keeps them; the simulator not
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob of each token

    @property
    def key(self) -> tuple[str, int]:
        """(prompt_id, sample) of its request in a rollout batch."""
        return (self.prompt_id, self.rid)

    def versions(self) -> list[int]:
        return [v for v, n in self.segments for _ in range(n)]

    def extend(self, n_new: int, version: int, done: bool, tokens: Iterable[int] = (),
               logprobs: Iterable[float] = ()) -> None:
        """Book one rollout's new tokens (possibly none) of this response."""
        if self.done:
            raise ValueError(f"response {self.key} is already complete")
        if n_new < 0:
            raise ValueError(f"response {self.key}: {n_new} new tokens")
        tokens, logprobs = list(tokens), list(logprobs)
        if tokens or self.tokens:
            if len(tokens) != n_new or len(logprobs) != n_new:
                raise ValueError(f"response {self.key}: {n_new} new tokens, {len(tokens)} ids, "
                                 f"{len(logprobs)} log-probs")
            self.tokens += tokens
            self.logprobs += logprobs
        if n_new:
            if self.segments and self.segments[-1][0] == version:
                self.segments[-1] = (version, self.segments[-1][1] + n_new)
            else:
                self.segments.append((version, n_new))
        self.n += n_new
        self.done = done

    def to_dict(self) -> dict:
        return {"prompt_id": self.prompt_id, "sample": self.sample, "prompt_len": self.prompt_len,
                "rid": self.rid, "n": self.n, "done": self.done, "segments": [list(s) for s in self.segments],
                "tokens": self.tokens, "logprobs": self.logprobs}

    @classmethod
    def from_dict(cls, d: dict) -> Carried:
        return cls(d["prompt_id"], int(d["sample"]), int(d["prompt_len"]), int(d["rid"]), int(d["n"]),
                   bool(d["done"]),
                   [(int(v), int(n)) for v, n in d["segments"]], list(d["tokens"]), list(d["logprobs"]))


@dataclass
class PendingGroup:
    uid: int  # launch order: older groups have smaller uids
    prompt_id: str
    payload: Any  # what the caller needs to train the group (the prompt; the trace epoch)
    samples: list[Carried]

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    def live(self) -> list[Carried]:
        return [s for s in self.samples if not s.done]


@dataclass
class Settled:
    """What one rollout handed to training, and what it carried over."""

    trained: list[PendingGroup]
    carried: int  # responses unfinished at the end of the rollout (resumed next rollout)
    waiting: int  # complete responses whose group is not complete (or not yet trained)
    trained_tokens: int
    off_policy_tokens: int  # trained tokens sampled by an older policy than this rollout's
    max_version_lag: int

    @property
    def off_policy_share(self) -> float:
        return self.off_policy_tokens / self.trained_tokens if self.trained_tokens else 0.0


class CarryPool:
    """The groups between rollouts; every rank (and the simulator) drives an identical pool."""

    def __init__(self, rule: PartialRule, group_size: int, target: int):
        if group_size < 1 or target < 1:
            raise ValueError(f"group_size and target: expected >= 1, got {group_size}, {target}")
        self.rule, self.group_size, self.target = rule, group_size, target
        self.pending: list[PendingGroup] = []  # launched, not yet trained, oldest first
        self.next_uid = 0
        self.trained_uids: list[int] = []

    def launch(self, fresh: Iterator[tuple[str, int, Any]]) -> list[PendingGroup]:
        """The groups of the next rollout: pending ones first (oldest first), then new groups from
        `fresh` ((prompt_id, prompt_len, payload) per group) up to `rule.launch_count(target)`."""
        want = self.rule.launch_count(self.target)
        groups = list(self.pending[:want])
        while len(groups) < want:
            item = next(fresh, None)
            if item is None:
                break
            pid, plen, payload = item
            u, G = self.next_uid, self.group_size
            g = PendingGroup(u, pid, payload, [Carried(pid, s, plen, u * G + s) for s in range(G)])
            self.next_uid += 1
            self.pending.append(g)
            groups.append(g)
        return groups

    def settle(self, version: int) -> Settled:
        """After the rollout of policy `version` booked its tokens (`Carried.extend`): up to `target`
        complete groups, oldest first, leave the pool for training."""
        trained = [g for g in self.pending if g.complete][: self.target]
        ids = {g.uid for g in trained}
        self.pending = [g for g in self.pending if g.uid not in ids]
        self.trained_uids += [g.uid for g in trained]
        total = stale = lag = 0
        for g in trained:
            for s in g.samples:
                for v, n in s.segments:
                    total += n
                    if v < version:
                        stale += n
                        lag = max(lag, version - v)
        carried = sum(1 for g in self.pending for s in g.samples if not s.done)
        waiting = sum(1 for g in self.pending for s in g.samples if s.done)
        return Settled(trained, carried, waiting, total, stale, lag)

    def dropped(self) -> int:
        """Responses launched that are neither trained nor pending (there must be none)."""
        kept = set(self.trained_uids) | {g.uid for g in self.pending}
        return sum(1 for u in range(self.next_uid) if u not in kept) * self.group_size

    def check(self) -> None:
        """Nothing lost or duplicated: every uid launched is trained once or pending."""
        pending = [g.uid for g in self.pending]
        seen = self.trained_uids + pending
        if self.dropped() or sorted(seen) != list(range(self.next_uid)):
            raise AssertionError(f"groups lost or duplicated: launched {self.next_uid}, trained "
                                 f"{len(self.trained_uids)}, pending {len(pending)}, distinct {len(set(seen))}")
        keys = [s.key for g in self.pending for s in g.samples]
        if len(keys) != len(set(keys)):
            raise AssertionError("a request key is pending twice")

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self, payload_to=lambda p: p) -> dict:
        return {"next_uid": self.next_uid, "trained": len(self.trained_uids),
                "pending": [{"uid": g.uid, "prompt_id": g.prompt_id, "payload": payload_to(g.payload),
                             "samples": [s.to_dict() for s in g.samples]} for g in self.pending]}

    def load_state_dict(self, state: dict, payload_from=lambda p: p) -> None:
        self.next_uid = int(state["next_uid"])
        self.pending = [PendingGroup(int(g["uid"]), g["prompt_id"], payload_from(g["payload"]),
                                     [Carried.from_dict(s) for s in g["samples"]]) for g in state["pending"]]
        pending = {g.uid for g in self.pending}
        # Only the count of trained groups matters after a resume (`check` counts uids).
        self.trained_uids = [u for u in range(self.next_uid) if u not in pending]
