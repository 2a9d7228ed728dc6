"""`flexfloor plan` (its flags and config: megatron_rl/cli/plan.py): the planner's plan for one
rollout of a trace's epoch, as JSON or a summary."""
from __future__ import annotations

import json
from collections import Counter

from elastic.planning.choices import PlanChoices
from elastic.planning.plan import PlanError
from elastic.planning.planner import plan_epoch
from elastic.planning.platform import Platform
from elastic.planning.shape import SHAPES
from elastic.trace import TraceError, read_trace
from megatron_rl.cli.plan import FLAGS, PlanConfig
from megatron_rl.commands.resolve import resolve
from megatron_rl.config import config_yaml
from megatron_rl.errors import FlexFloorError


def run(args) -> int:
    c = resolve(PlanConfig, None, args, FLAGS)
    if args.print_config:
        print(config_yaml(c), end="")
        return 0
    try:
        trace = read_trace(c.trace)
        epoch = trace.epochs[-1] if c.epoch is None else c.epoch
        choices = PlanChoices(c.ranks if c.floor is None else c.floor, c.tailguard, c.objective, c.alpha, c.seed)
        plan = plan_epoch(trace, epoch, platform=Platform(c.dims, SHAPES[c.model]), layout=c.layout,
                          choices=choices, oracle=c.oracle, max_response_len=c.max_response_len)
    except (TraceError, PlanError) as e:
        raise FlexFloorError(str(e)) from None
    if args.json:
        print(json.dumps(plan.to_dict()))
        return 0
    m = plan.meta
    print(f"plan for epoch {epoch} of {c.trace}: {len(plan.assignments)} responses on "
          f"{plan.ranks} ranks, layout {plan.layout}"
          f"{' (placed as ' + m['effective_layout'] + ')' if m['effective_layout'] != plan.layout else ''}"
          f", floor {plan.floor}, TailGuard {'on' if plan.tailguard else 'off'}, ownership {plan.ownership}")
    counts = Counter(a.rank for a in plan.assignments)
    for i, st in enumerate(plan.stages):
        trigger = f"after ranks {list(st.drained)} drain" if i else "at start"
        moved = len(plan.transfers(i - 1, i)) if i else 0
        print(f"  stage {i}: {len(st.members)} ranks {trigger}"
              f"{f', {moved} expert moves' if i else ''}")
    print("  responses per rank: " + " ".join(f"{r}:{counts.get(r, 0)}" for r in range(plan.ranks)))
    print(f"  predicted rollout {m['predicted_rollout_s']:.1f} s "
          f"(nobody leaving: {m['predicted_static_rollout_s']:.1f} s), "
          f"release area {plan.predicted_release_rank_s:.1f} rank-s, "
          f"occupied {m['predicted_occupied_rank_s']:.1f} rank-s")
    if "fallback" in m:
        print(f"  note: {m['fallback']}")
    return 0
