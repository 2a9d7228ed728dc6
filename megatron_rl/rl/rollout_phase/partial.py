"""Partial rollouts in training: the groups pending between steps, the step's requests, the end
rule at status checks, and what trains (docs/training.md, *Partial rollouts*). Off by default
(`partial.enabled`); the rules are `elastic.planning.partial`'s, as in the simulator.

Step s samples with policy version s (the weights after s - 1 updates). On every rank, alike:
1. `launch`: the pending groups first (oldest first), then fresh prompts from the data iterator,
   up to `prompts_per_step x (1 + over_sample)` groups;
2. `work`: one request per unfinished response. A carried one re-prefills its prompt and tokens so
   far under the new policy (its KV cache is not kept: the weights changed), may generate up to
   `max_response_len` minus its tokens, and is planned by what is left of it (`known_prefix`);
3. the rank rollout runs with `GroupsStop` (elastic/runtime/stop.py) as the runtime's end rule: at
   the first status check where `prompts_per_step` groups have no live sample, the members end the
   decode loop; the shrink, leases and restore run as they do without it;
4. `settle`: the gathered new tokens, behaviour log-probs and version s of every response are
   booked, and `prompts_per_step` complete groups (oldest first) train, in canonical order, each
   token with the log-prob of the policy that sampled it: `grpo.tis_cap` (required) weighs a stale
   token by min(exp(old_logp - behaviour_logp), cap). A group trains only when all its samples
   are complete; nothing is dropped (`CarryPool.check` after every step).

The pool and the prompts drawn but not yet launched are part of the checkpoint (`state_dict`), so
a resumed run continues the carried responses instead of losing them.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from elastic.planning.partial import CarryPool, PendingGroup, Settled
from elastic.runtime.stop import GroupsStop
from elastic.trace import TraceRecord
from megatron_rl.models.routes import encode as routes_encode
from megatron_rl.rl.checkpoint.route_state import load_routes
from megatron_rl.rl.rollout_phase.phase import Response, RolloutPhase, TrainingRollout, Work
from megatron_rl.rollout.rank_rollout import Generated


class PartialRollouts:
    """The trainer's side of partial rollouts; one per rank, driven identically on every rank."""

    def __init__(self, cfg, data, iterator, tokenizer):
        self.cfg, self.data, self.iterator, self.tok = cfg, data, iterator, tokenizer
        self.G = cfg.grpo.group_size
        self.pool = CarryPool(cfg.partial.rule(), self.G, cfg.prompts_per_step)
        self.queue: deque = deque()  # (data index, epoch) of the iterator's batch not launched yet
        self._ids: dict[int, list[int]] = {}
        self.last_trained: list[PendingGroup] = []  # the groups the last step trained
        # Each pending response's routes so far (models/routes.py), None where a resumed checkpoint
        # had none for it (it then trains without routing replay: `routes_missing`).
        self.routes: dict[tuple[str, int], torch.Tensor | None] = {}

    def ids(self, index: int) -> list[int]:
        if index not in self._ids:
            self._ids[index] = self.tok.encode_prompt(self.data[index])
        return self._ids[index]

    def _fresh(self):
        while True:
            if not self.queue:
                batch = self.iterator.next_batch()
                self.queue.extend((i, batch.epoch) for i in batch.indices)
            i, epoch = self.queue.popleft()
            yield self.data[i].prompt_id, len(self.ids(i)), {"index": i, "epoch": epoch}

    # ---- before the rollout --------------------------------------------------------------------
    def launch(self) -> tuple[list[PendingGroup], list[Work]]:
        """The step's groups and one request per unfinished response, in canonical order."""
        groups = self.pool.launch(self._fresh())
        max_new = self.cfg.generation.max_response_len
        work = [Work(g.prompt_id, s.rid, self.ids(g.payload["index"]) + s.tokens, max_new - s.n, s.n,
                     self.routes.get(s.key)) for g in groups for s in g.live()]
        return groups, work

    def stop(self, groups: list[PendingGroup], engine) -> GroupsStop:
        group_of = {s.key: i for i, g in enumerate(groups) for s in g.live()}
        return GroupsStop(engine, group_of, len(groups), self.pool.target)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, step: int, phase: RolloutPhase, history):
        """One partial rollout through the rollout phase (`RolloutPhase.generate`), then `settle`.
        Returns (prompts, `TrainingRollout` of the groups that train, their history records, the
        `partial` metrics)."""
        groups, work = self.launch()
        known = {w.key: w.prefix for w in work if w.prefix}
        lease_prompts = [self.data[g.payload["index"]] for g in groups]
        gen = phase.generate(step, work, history, lease_prompts, known_prefix=known or None,
                             stop=lambda engine: self.stop(groups, engine))
        settled = self.settle(groups, gen.requests, step)
        eos, G = self.tok.eos_id, self.G
        responses = [Response(i * G + s.sample, g.prompt_id, s.sample, self.ids(g.payload["index"]), s.tokens,
                              s.logprobs, s.tokens[-1] != eos, self.routes.pop(s.key, None))
                     for i, g in enumerate(settled.trained) for s in g.samples]
        # A lease scored a response from this rollout's tokens: right for a fresh one only.
        scored = {i * G + s.sample: gen.scored[s.key] for i, g in enumerate(settled.trained)
                  for s in g.samples if s.key in gen.scored and s.key not in known}
        rollout = TrainingRollout(responses, scored, gen.figures)
        return self.prompts(settled), rollout, self.history_records(settled), self.metrics(settled, gen.stop.complete)

    def settle(self, groups: list[PendingGroup], requests: dict[tuple[str, int], Generated], version: int) -> Settled:
        """Book `requests` (every request of the rollout, by key: its new tokens, their log-probs,
        whether it finished, its routes so far) at policy `version`; hand out the complete groups
        that train. A carried response without routes keeps none: routes of its new tokens alone
        would not cover it."""
        for g in groups:
            for s in g.live():
                r = requests[s.key]
                self.routes[s.key] = r.routes if s.n == 0 or self.routes.get(s.key) is not None else None
                s.extend(len(r.tokens), version, r.finished, r.tokens, r.logprobs)
        settled = self.pool.settle(version)
        self.pool.check()
        self.last_trained = settled.trained
        if len(settled.trained) != self.pool.target:
            raise AssertionError(f"partial rollout handed {len(settled.trained)} complete groups to training, "
                                 f"not {self.pool.target}")
        return settled

    def prompts(self, settled: Settled) -> list:
        return [self.data[g.payload["index"]] for g in settled.trained]

    def history_records(self, settled: Settled) -> list[TraceRecord]:
        """The trained responses' final lengths in the trace format (each under its group's epoch)."""
        return [TraceRecord(g.prompt_id, g.payload["epoch"], s.sample, len(self.ids(g.payload["index"])), s.n,
                            s.tokens[-1] != self.tok.eos_id)
                for g in settled.trained for s in g.samples]

    def metrics(self, settled: Settled, complete: int) -> dict:
        """`partial/...`: responses carried into the next step, off-policy token share of what
        trains, the largest version lag, dropped responses (none, or `settle` would have raised)."""
        lengths = [s.n for g in settled.trained for s in g.samples]
        return {"carried": settled.carried, "waiting": settled.waiting,
                "off_policy_token_share": settled.off_policy_share, "max_version_lag": settled.max_version_lag,
                "dropped": self.pool.dropped(), "pending_groups": len(self.pool.pending),
                "groups_complete_at_end": complete, "launched_groups": self.pool.next_uid,
                "trained_response_len_mean": float(np.mean(lengths)) if lengths else 0.0}

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """`routes`: [prompt_id, request sample, base64 routes] of every pending response that has
        them (`models.routes.encode`; checked on load)."""
        return {"pool": self.pool.state_dict(), "queue": [list(q) for q in self.queue],
                "routes": [[pid, rid, routes_encode(r)] for (pid, rid), r in self.routes.items() if r is not None]}

    def load_state_dict(self, state: dict, source: str = "trainer_state.json") -> None:
        """`source`: the file `state` came from, named by a bad field's message."""
        self.pool.load_state_dict(state["pool"])
        self.queue = deque((int(i), int(e)) for i, e in state["queue"])
        self.routes = load_routes(state.get("routes", []), self.pool, self.cfg.model, source)
