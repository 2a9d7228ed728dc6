"""The online rule: re-planning at every status check, shared by the runtime and the simulator.

    ladder.py          the stages the rule may choose, fixed (and their groups made) before the rollout
    rule.py            `OnlineRule`: the stage to be in and the requests to move, at each check
    grid.py            the sampled future one decision is priced on
    price.py           what a scenario costs ("stage j from now, with these requests moved")
    place.py           where live requests go, under each member's KV budget; the `Decision`
    latency_guard.py   the time an option may take (`max_slowdown`)
"""
