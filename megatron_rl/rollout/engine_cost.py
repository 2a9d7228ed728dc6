"""The step cost `flexfloor rollout` and `train` plan with: calibrated on the engine they run on.

The planner prices quorum chains with a `StepCost` (elastic/planning/release.py). Its default,
`ShapeCost`, describes an H100: on the tiny CPU model it prices a decode step at microseconds and a
shrink at 50 ms, so no chain ever pays and `--policy planned` never detaches a rank. The CPU engine
measures otherwise (tools/bench_sim_vs_engine.py, docs/simulator.md; `flexfloor rollout` ledgers on
the 2-core development machine, 2026-11-30): a decode step of the 4-rank tiny model costs 10-25 ms
whatever the group size, since fixed per-step overheads dominate, and a shrink about 6 ms plus 2 ms
per expert the busiest rank moves (9 ms measured for one expert), a restore some 10 ms more.

The plan is made on the trace's lengths while the run decodes `length_scale` of them, so a trace
token costs `length_scale` steps.
"""
from __future__ import annotations

from elastic.planning.release import FixedCost

# Middle of the measured 10-25 ms per decode step of the tiny model on 4 gloo ranks.
CPU_STEP_S = 0.015
# A shrink moving one or two experts per rank (measured 6-9 ms), the restore's extra left out.
CPU_SHRINK_S = 0.010


def engine_cost(length_scale: float = 1.0) -> FixedCost:
    """The CPU engine's step and shrink, per trace token of a run that decodes `length_scale`."""
    return FixedCost(step_s=CPU_STEP_S * length_scale, shrink_fixed_s=CPU_SHRINK_S)
