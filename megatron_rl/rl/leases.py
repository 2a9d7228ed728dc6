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

from elastic.runtime.pool import IdlePool
from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.rewards import Scorer, Verdict
from megatron_rl.rollout.engine import Request
from megatron_rl.rollout.lease_jobs import RewardScoringJob, lease_jobs, sidecar_job
from megatron_rl.trainer_config import TrainerConfig

SIDECAR_COUNTS = ("served", "tokens", "restarts")


class TrainingLeases:
    """One rank's leases over a training run: a pool per rollout, and what each step's leases did."""

    def __init__(self, cfg: TrainerConfig, tok: Tokenizer, rank: int, world: int):
        self.cfg, self.tok = cfg.leases, tok
        # Outcomes only (the reward phase's scorer counts them), from the same reward workers.
        self.scorer = Scorer(cfg.reward)
        self.sidecar = sidecar_job(self.cfg.jobs, self.cfg.sidecar, rank, world)
        self.rewards: RewardScoringJob | None = None
        self._sidecar_before: dict = {}

    def pool(self, finished: list[Request], prompts: list[Prompt], fault_here: bool) -> IdlePool:
        by_id = {p.prompt_id: p for p in prompts}
        self.scorer.new_step()  # this rollout's leases get the whole allowance of reward timeouts

        def outcome(r: Request) -> Verdict:
            return self.scorer.judge(self.tok.decode(r.tokens), by_id[r.prompt_id])

        jobs = lease_jobs(self.cfg.jobs, finished=finished, score=outcome, sidecar=self.sidecar,
                          fault=self.cfg.fault if fault_here else None)
        self.rewards = next((j for j in jobs if isinstance(j, RewardScoringJob)), None)
        if self.sidecar is not None:
            self._sidecar_before = self.sidecar.report()
        return IdlePool(jobs, lease_s=self.cfg.lease_s, grace_s=self.cfg.grace_s)

    def outcomes(self) -> dict[tuple[str, int], Verdict]:
        """The verdict of each response this rank's leases scored in this rollout."""
        return dict(self.rewards.scores) if self.rewards is not None else {}

    def step_report(self) -> dict:
        """This rank's sidecar work in this rollout (counts) and so far (per-query accuracy)."""
        if self.sidecar is None:
            return {}
        now = self.sidecar.report()
        out = {k: now[k] - self._sidecar_before.get(k, 0) for k in SIDECAR_COUNTS}
        out.update(correct=now["correct"], distinct=now["distinct"])
        return out


def lease_metrics(ledger: dict, pool_reports: list[dict], step_reports: list[dict], scored: int) -> dict:
    """The step's `lease` metrics (W&B `lease/...`): rank time, rewards scored in leases, sidecar."""
    leased, idle = ledger["rank_seconds"]["leased"], ledger["rank_seconds"]["idle"]
    out = {"leased_rank_s": leased, "idle_rank_s": idle,
           "leased_share": leased / (leased + idle) if leased + idle > 0 else 0.0,
           "leases": sum(len(p.get("leases", [])) for p in pool_reports),
           "rewards_scored": scored}
    if any(step_reports):
        for k in SIDECAR_COUNTS:
            out[f"sidecar_{k}"] = sum(r.get(k, 0) for r in step_reports)
        distinct = sum(r.get("distinct", 0) for r in step_reports)
        out["sidecar_queries_answered"] = distinct
        out["sidecar_accuracy"] = (sum(r.get("correct", 0) for r in step_reports) / distinct
                                   if distinct else None)
    return out
