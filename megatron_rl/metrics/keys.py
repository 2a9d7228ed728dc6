"""The names metrics go by: the trainer's raw per-step dict -> verl-style grouped keys.

The trainer (and the rollout phase, the lease pool, ...) produce a nested dict with their own
names (`reward_mean`, `phase_s: {rollout: ...}`, the ledger's `rank_seconds: {...}`). Users
coming from verl look for `reward/mean`, `timing_s/gen`, `actor/lr`; so both `metrics.jsonl` and
W&B carry the grouped names of `grouped()`, from one table here. docs/training.md lists the same
table, and tests/unit/megatron_rl/test_metric_keys.py holds the two together.

A key the table does not know keeps its own name: a new measurement shows up under its raw name
rather than vanish, and the docs test names it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# raw top-level key -> grouped name. A nested dict keeps its sub-keys under the new name
# (`rank_seconds: {dummy: ..}` -> `elastic/rank_seconds/dummy`).
KEYS: dict[str, str] = {
    "epoch": "training/epoch",
    "reward_mean": "reward/mean",
    "reward_std": "reward/std",
    "reward_outcomes": "reward/outcomes",
    "reward_extra": "reward/extra",  # a custom reward's dict keys (rewards/custom.py)
    "reward_all_error": "reward/all_error",  # only on a step whose every response scored error
    # verl's own figures (metrics/verl.py)
    "global_step": "training/global_step",
    "advantages": "critic/advantages",
    "prompt_len": "prompt_length",
    "per_token_ms": "timing_per_token_ms",
    "throughput": "perf/throughput",
    "mfu_actor": "perf/mfu/actor",
    "response_len_mean": "response_length/mean",
    "response_len_p50": "response_length/p50",
    "response_len_p99": "response_length/p99",
    "response_len_max": "response_length/max",
    "truncated_share": "response_length/clip_ratio",
    "phase_s": "timing_s",
    "step_s": "timing_s/step",
    "loss": "actor/loss",
    "grad_norm": "actor/grad_norm",
    "lr": "actor/lr",
    "entropy": "actor/entropy",
    "kl": "actor/kl",
    "clip_frac": "actor/clip_frac",
    "ratio_mean": "actor/ratio_mean",
    "tis_weight_mean": "actor/tis_weight_mean",
    "ppo_kl": "actor/ppo_kl",  # rl/update/stats.py: per-update diagnostics
    "rollout_gap": "rollout/logp_gap",
    "rollout_gap_max": "rollout/logp_gap_max",
    "mismatch": "mismatch",  # rl/update/mismatch.py: router agreement, flips, logp diff, k3 KL, TIS/MIS shares
    "engine": "rollout/engine",  # the run's one rollout engine: builds, graph_captures (rl/rollout_phase/phase.py)
    "update_rel": "actor/update_rel",
    "update_changed": "actor/update_changed",
    "val": "val",  # held-out validation (rl/validation.py): val/pass@1, val/reward_mean, ...
    "val_core": "val-core",  # per data source, verl's names: val-core/<source>/reward/mean@N, ...
    # the rollout phase's ledger (elastic.ledger.Ledger.summary) and plan
    "ranks": "elastic/ranks",
    "rollout_time_s": "elastic/rollout_time_s",
    "rollout_steps": "elastic/rollout_steps",
    "rank_seconds": "elastic/rank_seconds",
    "rank_steps": "elastic/rank_steps",
    "dummy_share": "elastic/dummy_share",
    "occupied_rank_s": "elastic/occupied_rank_s",
    "detached_rank_s": "elastic/detached_rank_s",
    "tokens_per_occupied_rank_s": "elastic/tokens_per_occupied_rank_s",
    "stages": "elastic/stages",
    "final_stage": "elastic/final_stage",
    "shrink_latency_s": "elastic/shrink_latency_s",
    "restore_s": "elastic/restore_s",
    "floor": "elastic/floor",
    "layout": "elastic/layout",
    "placement": "elastic/placement",
    "response_tokens": "perf/response_tokens",
    "tokens_per_s": "perf/tokens_per_s",
    "max_memory_allocated_gb": "perf/max_memory_allocated_gb",
    "max_memory_reserved_gb": "perf/max_memory_reserved_gb",
    "lease": "lease",
    "partial": "partial",  # partial rollouts (rl/rollout_phase/partial.py)
    "pool": "lease/pool",  # the rollout report's per-rank lease pool reports
}
# verl's names of the trainer's phases (timing_s/gen is what a verl user looks for).
PHASES = {"rollout": "gen", "reward": "reward", "logprob": "old_log_prob", "update": "update_actor",
          "sync": "sync"}
# verl's name of a figure both frameworks log, emitted beside ours (grouped name -> verl's).
VERL_ALIASES = {"reward/mean": "critic/score/mean", "actor/loss": "actor/pg_loss",
                "actor/clip_frac": "actor/pg_clipfrac"}
# The lease pool's figures pass through under lease/: a `lease` dict (in KEYS) or keys `lease_*`.
LEASE = "lease"


def group_name(key: str) -> str:
    if key in KEYS:
        return KEYS[key]
    if key.startswith(LEASE + "_"):
        return f"{LEASE}/{key[len(LEASE) + 1:]}"
    return key


def _leaves(value: Any, name: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _leaves(v, f"{name}/{k}", out)
    elif isinstance(value, (np.integer, np.floating, np.bool_)):
        out[name] = value.item()
    else:
        out[name] = value


def grouped(metrics: dict[str, Any]) -> dict[str, Any]:
    """{'reward_mean': .5, 'phase_s': {'rollout': 2.}} -> {'reward/mean': .5, 'timing_s/gen': 2.}.

    Every leaf is kept (strings and lists too: metrics.jsonl holds them); `numeric()` picks what
    W&B charts. `stages` (a list of rank lists) also gives `elastic/num_stages` and
    `elastic/floor_ranks`, the chartable part of it.
    """
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if key in ("phase_s", "per_token_ms"):
            value = {PHASES.get(k, k): v for k, v in value.items()}
        _leaves(value, group_name(key), out)
        if key == "stages" and value:
            out["elastic/num_stages"] = len(value)
            out["elastic/floor_ranks"] = min(len(s) for s in value)
    for ours, verl in VERL_ALIASES.items():
        if ours in out:
            out[verl] = out[ours]
    return out


def numeric(flat: dict[str, Any]) -> dict[str, float]:
    """The numbers of a `grouped()` dict (W&B charts numbers)."""
    return {k: float(v) for k, v in flat.items() if isinstance(v, (bool, int, float))}
