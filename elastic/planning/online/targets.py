"""Which stages the online rule should consider shrinking to now (`shrink_targets`): every target
and every later shrink to it (D = one check, then doubling) priced per sample at its busiest member,
with the leaving ranks' requests dealt to the members that stay (`place.deal`).

Apart from the rule because it is its even-spread estimate, one vectorised pass over the sampled
future (`grid.Grid`), which the rule then checks for the best few targets with each request placed
within the KV budgets (`place.place`, `price.Prices.exact`).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from elastic.planning.online.grid import Grid, batch_context
from elastic.planning.online.place import deal, member_mask
from elastic.planning.online.price import Prices, migrate_s

# Shrink targets priced exactly per decision, best first by `shrink_targets`' even-spread estimate
# (a large shrink can look best spread evenly and lose once its requests have places).
SHRINK_CANDIDATES = 3


def shrink_targets(prices: Prices, stage: int, targets: list[int], grid: Grid, key: Callable,
                   bound: Callable[[float], float] | None) -> list[int]:
    """The targets to shrink to now, best first, or none when staying (perhaps to shrink later)
    is best, under the objective's sort `key` and, with `bound` (`LatencyGuard.bound`), only
    among the options it allows. The leaving ranks' requests are dealt to the members that stay
    (`place.deal`) and every option is priced per sample at its busiest member: spread evenly
    instead, a large shrink looked faster than it ran (the busiest of 64 members holding 250
    requests each is some 15% above their mean)."""
    plan, cost = prices.plan, prices.cost
    S = grid.seg.shape[0]
    W, g0 = plan.ranks, prices.sizes[stage]
    seg, bounds, delays, rem, ranks, held = grid.seg, grid.bounds, grid.delays, grid.rem, grid.ranks, grid.held

    def busiest(j: int) -> tuple[np.ndarray, np.ndarray]:
        kept = list(plan.stages[j].members)
        count, kv = grid.per_rank(deal(plan, j, ranks, rem) if j != stage else ranks)
        return batch_context(count[:, :, kept].max(axis=2), kv[:, :, kept].max(axis=2))

    tau_now = prices.steps(*busiest(stage), g0)
    run_now = seg * tau_now[None, :]
    before = np.concatenate([np.zeros((S, 1)), np.cumsum(run_now, axis=1)], axis=1)  # time to bound k
    kv_token = float(prices.shape.kv_bytes_per_token)
    stay = before[:, -1] + prices.restore_s[stage]
    options = [(prices.estimate(stay, np.zeros(S), g0, g0, W)[0], stage, 0)]
    staying = key((options[0][0],))
    d = np.array([0] + delays, float)
    at = np.searchsorted(bounds, d)
    for j in targets:
        g = prices.sizes[j]
        after = seg * prices.steps(*busiest(j), g)[None, :]
        tail = np.concatenate([np.cumsum(after[:, ::-1], axis=1)[:, ::-1], np.zeros((S, 1))], axis=1)
        moving = ~member_mask(plan.stages[j].members, W)[ranks]
        # The requests still live at the shrink move, their KV grown by d tokens: each leaving
        # rank sends its own, the members receive them spread evenly: `busiest_load`'s tally in
        # expectation, one column per delay.
        per = (rem[:, moving, None] > d).mean(axis=0) * (held[moving][:, None] + d)  # (moving, delays)
        senders = np.bincount(ranks[moving], minlength=W) > 0
        sender = (np.cumsum(senders) - 1)[ranks[moving]]  # each request's sender, numbered in rank order
        sent = np.zeros((max(int(senders.sum()), 1), len(d)))
        np.add.at(sent, sender, per)
        moved = kv_token * np.maximum(sent.max(axis=0), per.sum(axis=0) / g)
        shrink = cost.shrink_s(prices.moved(stage, j), g0) \
            + np.array([migrate_s(cost, b, g0) for b in moved])
        until = before[:, at] + shrink[None, :]
        whole = until + tail[:, at] + prices.restore_s[j]
        for est, delay in zip(prices.estimate(whole, until, g0, g, W), d):
            options.append((est, j, delay))
    # Whatever the objective, no option predicted to take longer than `LatencyGuard.bound` allows: in a
    # synchronous job a slower rollout holds every rank back (`max_slowdown` None: no guard,
    # the objective alone decides, as in `make_plan`).
    if bound is not None:
        limit = bound(min(o[0].rollout_s for o in options))
        options = [o for o in options if o[0].rollout_s <= limit]
    ranked = sorted(options, key=lambda o: (key((o[0],)), o[2]))
    if ranked[0][1] == stage or ranked[0][2] != 0:  # staying, or shrinking later, is best
        return []
    now = [j for est, j, delay in ranked if delay == 0 and j != stage and key((est,)) < staying]
    return list(dict.fromkeys(now))[:SHRINK_CANDIDATES]
