"""The step cost `flexfloor rollout` and `train` plan with: calibrated on the engine they run on.

The planner prices quorum chains with a `StepCost` (elastic/planning/chains/estimate.py). Its default,
`ShapeCost`, describes an H100: on the tiny CPU model it prices a decode step at microseconds and a
shrink at 50 ms, so no chain ever pays and `--policy planned` never detaches a rank. The CPU engine
measures otherwise (tools/bench_sim_vs_engine.py, docs/simulator.md; `flexfloor rollout` ledgers on
the 2-core development machine, 2026-11-30): a decode step of the 4-rank tiny model costs 10-25 ms
whatever the group size, since fixed per-step overheads dominate (a live request adds a little),
and a shrink about 6 ms plus 2 ms per expert the busiest rank moves, a restore some 10 ms more.

The plan is made on the trace's lengths while the run decodes `length_scale` of them, so a trace
token costs `length_scale` steps.
"""
from __future__ import annotations

from dataclasses import dataclass

# Measured 10-25 ms per decode step of the 4-rank tiny model on gloo (busy rank-seconds over busy
# rank-steps of `flexfloor rollout` ledgers); one rank alone steps in about 4 ms plus 0.25 ms per
# live request (1 -> 64 requests: 4 -> 22 ms, timed with RolloutEngine on float64).
CPU_STEP_FIXED_S = 0.011
CPU_STEP_PER_REQUEST_S = 0.00025
# A shrink moving one or two experts per rank (measured 6-9 ms), the restore's extra left out.
CPU_SHRINK_S = 0.010
# Moving live requests over gloo on one host: 54 requests, 12.9 MB of KV, took 2.0 s (`flexfloor
# rollout --policy adaptive`, 2026-11-30): per-message latency, not bandwidth, dominates. The rule
# prices the busiest rank's sends or receives; those runs moved nearly all requests onto one rank.
CPU_MIGRATE_BYTES_PER_S = 6e6


@dataclass(frozen=True)
class EngineCost:
    """The CPU engine's `StepCost` per trace token of a run that decodes `length_scale` of each
    traced length: a step is a fixed cost plus a small one per live request, whatever the group."""

    length_scale: float = 1.0

    def decode_step_s(self, batch_per_rank: int, context: int, ep_size: int) -> float:
        return self.length_scale * (CPU_STEP_FIXED_S + CPU_STEP_PER_REQUEST_S * max(batch_per_rank, 0))

    def shrink_s(self, experts_moved: int, ep_size: int) -> float:
        return CPU_SHRINK_S

    def migrate_s(self, kv_bytes: float, ep_size: int) -> float:
        # `kv_bytes` counts trace tokens; the run holds `length_scale` of each response's.
        return self.length_scale * float(kv_bytes) / CPU_MIGRATE_BYTES_PER_S


def engine_cost(length_scale: float = 1.0) -> EngineCost:
    return EngineCost(length_scale)
