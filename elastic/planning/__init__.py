"""What the planner decides: pure Python over dataclasses, no torch and no torch.distributed.

    plan.py, dims.py          the plan (stages, assignments, the invariants) and the layout of the ranks
    planner.py                `make_plan`, the one entry point; policies.py: each policy's plan and
                              online rule; choices.py: the names a command may choose (no numpy)
    layout.py                 which rank runs each response (`natural`, `lengthsort`, `planned`)
    shape.py, step_cost.py    the model's shape and memory budget; what a decode step and a shrink cost
    platform.py               what a plan is priced on (layout, shape, budget, step cost), built once
    partial.py                partial rollouts' rules (over-sampling, carried responses)
    busiest.py                the busiest rank's share of a batch of moves
    lengths/                  what is believed about response lengths: prediction, TailGuard, re-prediction
    memory/                   KV and memory pricing: how a cache holds a request, KV demand, training memory
    chains/                   the quorum schedules and the search over them
    online/                   the online rule: its ladder of stages, re-planning, placement and prices
"""
