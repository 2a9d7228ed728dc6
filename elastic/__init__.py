"""elastic: FlexFloor's contribution, in four floors, each using only those below it.

    trace.py, ledger.py  length traces and the rank-time ledger (pure data; everyone reads them)
    planning/            what the planner decides: prediction, TailGuard, layouts, quorum schedules,
                         the online rule, plans (pure Python over dataclasses, no torch, no dist)
    runtime/             carrying a plan out on live ranks (torch.distributed) through an engine that
                         implements `elastic.runtime.interface.ElasticEngine`
    sim/                 the same plans on a cluster cost model (simulator, calibration, reports)

`elastic` never imports `megatron_rl`.
"""
