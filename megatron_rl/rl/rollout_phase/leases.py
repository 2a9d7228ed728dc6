"""Leases inside `flexfloor train`: what a rank the rollout detached does until the restore.

A detached rank holds its own finished responses, the tokenizer, the prompts' reference answers
and the replicated dense weights; its experts are gone. With that it can do one piece of the
step's post-rollout work: **reward scoring** (decode + the task's verifier, `reward.kind`; with
`math` that is math-verify, the slowest part of the reward phase; with `custom`, the user's
function, in the same reward workers and under the same timeout and error counting as in the
reward phase). Its outcomes are all-gathered with the responses, and the reward phase scores only
what no lease did. The other post-rollout work cannot move here: micro-batch packing mixes rows
generated on other ranks (rows are owned in canonical order, not by the rank that made them), and
log-prob recomputation needs every expert.
After the training work comes the sidecar (`leases.jobs: [rewards, sidecar]`), whose job lives
as long as the run, so its model loads once.

Rewards are the same with and without leases: a lease records the verifier's verdict, and the
reward phase credits it exactly as it would have credited its own (one rank adds it into an
all-reduce of zeros). Deadlines, pre-emption and `LeaseTimeout` are the rollout CLI's: the pool of
`elastic/runtime/pool.py` with `leases.lease_s` / `leases.grace_s`, capped at the plan's
predicted restoration.
"""
from __future__ import annotations

from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.rewards import Scorer, Verdict
from megatron_rl.rollout.engine import Request
from megatron_rl.rollout.leases.jobs import SIDECAR_COUNTS, RolloutLeases, sidecar_job
from megatron_rl.trainer_config import TrainerConfig


class TrainingLeases:
    """One rank's leases over a training run: the sidecar it keeps, and each rollout's leases."""

    def __init__(self, cfg: TrainerConfig, tok: Tokenizer, rank: int, world: int):
        self.cfg, self.tok = cfg.leases, tok
        # Outcomes only (the reward phase's scorer counts them), from the same reward workers.
        self.scorer = Scorer(cfg.reward)
        self.sidecar = sidecar_job(self.cfg.jobs, self.cfg.sidecar, rank, world)

    def rollout(self, finished: list[Request], prompts: list[Prompt], fault_here: bool) -> RolloutLeases:
        """A rollout's leases over `finished` (the engine's list) of `prompts`: rewards are the
        task's verdicts."""
        by_id = {p.prompt_id: p for p in prompts}
        self.scorer.new_step()  # this rollout's leases get the whole allowance of reward timeouts

        def outcome(r: Request) -> Verdict:
            return self.scorer.judge(self.tok.decode(r.tokens), by_id[r.prompt_id])

        return RolloutLeases.build(self.cfg, finished, outcome, self.sidecar, self.cfg.fault if fault_here else None)


def lease_metrics(ledger: dict, pool_reports: list[dict], sidecars: list[dict], scored: int) -> dict:
    """The step's `lease` metrics (W&B `lease/...`): rank time, rewards scored in leases, sidecar
    work (`sidecars`: each rank's `LeaseOutcome.sidecar`)."""
    leased, idle = ledger["rank_seconds"]["leased"], ledger["rank_seconds"]["idle"]
    out = {"leased_rank_s": leased, "idle_rank_s": idle,
           "leased_share": leased / (leased + idle) if leased + idle > 0 else 0.0,
           "leases": sum(len(p.get("leases", [])) for p in pool_reports),
           "rewards_scored": scored}
    if any(sidecars):
        for k in SIDECAR_COUNTS:
            out[f"sidecar_{k}"] = sum(r.get(k, 0) for r in sidecars)
        distinct = sum(r.get("distinct", 0) for r in sidecars)
        out["sidecar_queries_answered"] = distinct
        out["sidecar_accuracy"] = (sum(r.get("correct", 0) for r in sidecars) / distinct
                                   if distinct else None)
    return out
