"""Partial rollouts in the simulator: the same trace, over-sampled, ended early, the rest carried.

`simulate_partial` runs one rollout per rollout epoch (as `replay.simulate_trace` does), each
training `target` GRPO groups (the groups of one epoch, what a synchronous rollout trains). The
groups come as a stream: the rollout epochs' groups in trace order, then those of any later epoch
of the trace (so the last rollouts can over-sample too). Per rollout, with the pure rules of
`elastic.planning.partial`:

1. `CarryPool.launch`: the pending groups, oldest first, then fresh ones, up to
   `target x (1 + over_sample)`;
2. every unfinished response of them is one batch record: a resumed one re-prefills its prompt and
   tokens so far (`prompt_len + tokens`) and decodes what is left of its traced length; the planner
   is told its tokens so far (`make_plan(known_prefix=...)`, and the online rule's model for
   `adaptive`), so it is planned by its remaining length;
3. the end rule cuts each record: `groups`, at the first status check where `target` groups are
   complete (request progress is counted in steps, so that check does not depend on the policy);
   `budget`, at `token_budget` new tokens;
4. the policy's plan is simulated on the cut records (`simulate.simulate_rollout`), and the pool
   books the tokens (policy version = the rollout's index) and hands out up to `target` complete
   groups.

The history the planner reads is the trace before the rollout's epoch without the groups still
pending (their final lengths are not known yet): no length of the batch leaks into its plan.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from elastic.planning.partial import CarryPool, PartialRule, groups_end_step
from elastic.planning.shape import ModelShape
from elastic.sim.costmodel import CostModel
from elastic.sim.replay import Policy, TraceResult, make_policy_plan, make_policy_rule, rollout_epochs
from elastic.sim.simulate import SimConfig, simulate_rollout
from elastic.trace import Trace, TraceRecord


def _stream(trace: Trace, first: int) -> Iterator[tuple[str, int, tuple[int, dict[int, TraceRecord]]]]:
    """(prompt_id, prompt_len, (epoch, records by sample)) of every group from epoch `first` on."""
    for e in trace.epochs:
        if e < first:
            continue
        groups: dict[str, dict[int, TraceRecord]] = {}
        for r in trace.epoch(e):
            groups.setdefault(r.prompt_id, {})[r.sample] = r
        for pid, recs in groups.items():
            yield pid, next(iter(recs.values())).prompt_len, (e, recs)


def simulate_partial(trace: Trace, policy: Policy, rule: PartialRule, *, ranks: int, cost: CostModel,
                     shape: ModelShape, config: SimConfig | None = None,
                     epochs: list[int] | None = None, tell_prefix: bool = True) -> TraceResult:
    """`tell_prefix=False` (an ablation) hides the resumed responses' tokens so far from the planner
    and the online rule: they are then planned by their whole predicted length."""
    config = config or SimConfig()
    epochs = epochs if epochs is not None else rollout_epochs(trace)
    first = trace.epoch(epochs[0])
    target = len({r.prompt_id for r in first})
    group_size = max(r.sample for r in first) + 1
    pool = CarryPool(rule, group_size, target)
    stream = _stream(trace, epochs[0])
    result = TraceResult(policy, ranks)
    totals = {"carried": 0, "trained_groups": 0, "trained_tokens": 0, "off_policy_tokens": 0,
              "max_version_lag": 0, "resumed": 0}
    for version, e in enumerate(epochs):
        groups = pool.launch(stream)
        pending = {(g.prompt_id, g.payload[0]) for g in pool.pending}
        history = Trace([r for r in trace.before(e) if (r.prompt_id, r.epoch) not in pending], "history")
        live = [(g, s) for g in groups for s in g.live()]
        remaining = np.array([g.payload[1][s.sample].response_len - s.n for g, s in live], dtype=np.int64)
        if rule.end == "budget":
            run = np.minimum(remaining, rule.token_budget)
        else:
            # Decode step at which each group's last live sample ends (the prefill emits one token).
            at = {g.uid: -1 for g in groups}
            for (g, _), rem in zip(live, remaining):
                at[g.uid] = max(at[g.uid], int(rem) - 1)
            stop = groups_end_step(np.array(list(at.values())), target, config.check_every)
            run = np.minimum(remaining, stop + 1)
        batch = []
        for (g, s), n in zip(live, run):
            rec = g.payload[1][s.sample]
            batch.append(TraceRecord(g.prompt_id, rec.epoch, s.rid, rec.prompt_len + s.n, int(n),
                                     rec.truncated and s.n + int(n) >= rec.response_len))
        known = {s.key: s.n for _, s in live if s.n}
        totals["resumed"] += len(known)
        told = known if tell_prefix else None
        if batch:
            plan = make_policy_plan(policy, batch, history, ranks=ranks, shape=shape, cost=cost,
                                    known_prefix=told, kv=config.unit)
            online = make_policy_rule(policy, plan, batch, history, shape=shape, cost=cost, config=config,
                                      known_prefix=told)
            result.plans.append(plan)
            result.rollouts.append(simulate_rollout(plan, batch, cost, shape, config, online, known))
        for (g, s), n in zip(live, run):
            s.extend(int(n), version, s.n + int(n) >= g.payload[1][s.sample].response_len)
        settled = pool.settle(version)
        pool.check()
        totals["carried"] += settled.carried
        totals["trained_groups"] += len(settled.trained)
        totals["trained_tokens"] += settled.trained_tokens
        totals["off_policy_tokens"] += settled.off_policy_tokens
        totals["max_version_lag"] = max(totals["max_version_lag"], settled.max_version_lag)
    totals["off_policy_share"] = totals["off_policy_tokens"] / max(totals["trained_tokens"], 1)
    totals["pending_groups_at_end"] = len(pool.pending)
    totals["dropped"] = pool.dropped()
    totals["rule"] = rule.describe
    result.partial = totals
    return result
