"""How a run plans its rollouts, as both `flexfloor rollout` and `train` ask for it: the model's
config (a checkpoint's headers checked before any rank starts), and `RolloutPlanner`, built once per
run from the command's config (the policy, the layout, the floor, the model's shape priced against
the memory budget, the step costs), whose `setup` makes each rollout's `RolloutSetup`: the plan of
the policy and, for an `adaptive` plan, its online rule. The rank rollout (`rank_rollout.py`)
carries the plan out.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from elastic.planning.choices import PlanChoices
from elastic.planning.dims import ParallelDims
from elastic.planning.lengths.remaining import OnlineOptions
from elastic.planning.online.rule import OnlineRule, RuleConfig
from elastic.planning.plan import Plan
from elastic.planning.planner import PlanError
from elastic.planning.platform import Platform
from elastic.planning.policies import PolicyError, PolicyKind, policy_kind
from elastic.planning.shape import MemoryBudget, ModelShape
from elastic.planning.step_cost import ShapeCost, StepCost
from megatron_rl.backend_rules import backend_rules
from megatron_rl.errors import FlexFloorError
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.hf import check_hf_checkpoint, check_same_shape
from megatron_rl.models.qwen3_moe import DTYPES
from megatron_rl.parallel.dims import parallel_dims
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine_cost import engine_cost
from megatron_rl.rollout.memory import memory_budget


def model_config(cfg: RolloutConfig) -> tuple[MoEModelConfig, ParallelDims]:
    """The model's configuration and the command's layout over it, each built once; a checkpoint is
    checked here (headers only), before any rank starts. With a checkpoint its config.json decides;
    a `model:` other than the built-in default must then equal it, so a config never silently runs
    another model than it names. Without one, the config built the layout at load (`cfg.dims`)."""
    if cfg.checkpoint is None:
        return cfg.model, cfg.dims
    if cfg.model != MoEModelConfig():
        check_same_shape(cfg.checkpoint, cfg.model, where="model:")
    mcfg = check_hf_checkpoint(cfg.checkpoint)
    mcfg.require_page_fits(cfg.kv_page_size, "kv_page_size")
    return mcfg, parallel_dims(cfg.ranks, mcfg.num_moe_experts, cfg.backend, f"num_experts of {cfg.checkpoint}")


@dataclass(frozen=True)
class RolloutSetup:
    """One rollout's plan and, for an `adaptive` plan that shrinks, its online rule (None
    otherwise), made together by `RolloutPlanner.setup`."""

    plan: Plan
    rule: OnlineRule | None


def run_cost(shape: ModelShape, device: str, length_scale: float = 1.0,
             shrink_cost_s: float | None = None) -> StepCost:
    """The one price of a step and of a shrink that a run's plans and its online rule both use: on
    CPU this engine's measured step and shrink (`engine_cost`, the run decoding `length_scale` of
    each trace length), on GPU the shape's cost model; `shrink_cost_s` instead prices a shrink at
    that fixed cost on the shape's model. (A plan priced one way and a rule another plans shrinks
    that the rule then cancels, paying for its checks every rollout.)"""
    if shrink_cost_s is not None:
        return ShapeCost(shape, shrink_fixed_s=shrink_cost_s)
    return engine_cost(length_scale) if device == "cpu" else ShapeCost(shape)


@dataclass
class RolloutPlanner:
    """What a run decides once about planning its rollouts; `setup` plans each one.

    `floor`: the floor the policy plans to (every rank if it never shrinks); `shape`: the model's
    shape priced against `budget` (`rollout/memory.py`), whose `kv` is how the run's KV cache holds
    a request; `cost`: `run_cost`'s, what both the plans and the online rule price steps and shrinks
    with. The rule reasons in trace tokens (the driver divides the run's by the length scale)
    and checks every `check_every` trace tokens. It runs without its latency guard and, like
    `planned`, shrinks when the objective's occupied rank-seconds say it pays. `max_response_len`:
    the responses' cap (`train`'s); None for a replayed trace, whose batch's longest response
    bounds its KV when there is no earlier epoch to learn a cap from. `max_batch`: the requests an
    engine rank holds at once. `migrate`: whether the rule moves live requests."""

    kind: PolicyKind
    dims: ParallelDims
    floor: int
    tailguard: bool
    budget: MemoryBudget
    shape: ModelShape
    cost: StepCost
    check_every: int
    max_batch: int
    max_response_len: int | None = None
    migrate: bool = True

    @classmethod
    def for_rollout(cls, cfg: RolloutConfig, mcfg: MoEModelConfig, dims: ParallelDims, device: str) -> RolloutPlanner:
        """`flexfloor rollout`'s: `mcfg`, `dims` are `model_config`'s, `device` the config's resolved
        device. Every rank computes on that device; one GPU (or this host's RAM over the ranks on
        it) stands for each rank's budget."""
        dtype_bytes, scale, kind = DTYPES[cfg.dtype].itemsize, cfg.batch.length_scale, policy_kind(cfg.policy)
        budget = memory_budget(mcfg, dtype_bytes, torch.device(device), dims.ranks_per_node,
                               kv=cfg.kv_kind.unit, expert_copies=backend_rules(cfg.backend).expert_copies)
        shape = mcfg.shape(dtype_bytes, budget, ranks_per_node=dims.ranks_per_node)
        return cls(kind, dims, kind.floor(dims.world, cfg.floor), cfg.tailguard, budget, shape,
                   cost=run_cost(shape, device, scale),
                   check_every=max(1, round(cfg.status_interval / scale)), max_batch=cfg.max_batch_per_rank)

    def setup(self, batch, history, known_prefix: dict | None = None) -> RolloutSetup:
        """The plan of one rollout of `batch` (its responses' `prompt_id`, `sample`, `prompt_len`;
        a replayed trace's `response_len`) after `history`, and its online rule. `known_prefix`:
        tokens so far of resumed responses (partial rollouts), by key."""
        plan = self.plan(batch, history, known_prefix)
        return RolloutSetup(plan, self.rule(plan, batch, history, known_prefix))

    def plan(self, batch, history, known_prefix: dict | None = None) -> Plan:
        """The policy's plan on the command's layout, its memory checks priced against the budget.
        When a shrinking policy keeps every rank, the plan's meta says why (`say_plan_notes`)."""
        W = self.dims.world
        cap = self.max_response_len
        if cap is None and not len(history):
            cap = max(r.response_len for r in batch)
        try:
            # A plan that keeps every rank predicts no gain: `adaptive` then takes the vanilla path too (one
            # stage, no online rule: no per-response status collective, no re-planning, no ladder's groups).
            plan = self.kind.plan(batch, history, platform=Platform(self.dims, self.shape, self.cost, self.budget),
                                  choices=PlanChoices(self.floor, self.tailguard), max_response_len=cap,
                                  known_prefix=known_prefix)
        except PolicyError as e:
            raise FlexFloorError(f"policy {self.kind.name}: {e}") from None
        except PlanError as e:
            raise FlexFloorError(f"planner: {e}") from None
        if len(plan.stages) == 1 and self.floor < W and "kv_queued" not in plan.meta:
            m, path = plan.meta, " (the vanilla path)" if self.kind.online else ""
            m["every_rank_stays"] = (
                f"{self.kind.name} floor {self.floor}: every rank stays{path}: "
                f"of {m['chains_priced']} chains priced "
                f"({m['chains_feasible']} fit the KV cache), keeping all {W} ranks has the fewest predicted "
                f"occupied rank-seconds ({m['predicted_occupied_rank_s']:.3g}; rollout "
                f"{m['predicted_rollout_s']:.3g} s, a shrink {self.cost.shrink_s(1, W):.3g} s)")
        return plan

    def rule(self, plan: Plan, batch, history, known_prefix: dict | None = None) -> OnlineRule | None:
        """The online rule of an `adaptive` plan, priced on this engine, or None for the other
        policies and for a plan that keeps every rank (the vanilla path); `batch` in
        `plan.assignments` order."""
        config = RuleConfig(check_every=self.check_every, max_slowdown=None, max_batch=self.max_batch,
                            kv=self.budget.kv)
        rule = self.kind.rule(plan, batch, history, cost=self.cost, shape=self.shape,
                              options=OnlineOptions(migrate=self.migrate), config=config,
                              max_response_len=self.max_response_len, known_prefix=known_prefix)
        if rule is not None:
            plan.meta["online"]["migrate"] = self.migrate
        return rule


def say_plan_notes(plan: Plan) -> None:
    """What the planner decided that a user would not guess, on stderr; the caller says it once
    per run, not once per rank: a raised floor, and why a shrinking policy keeps every rank."""
    for key in ("floor_raised", "kv_queued", "every_rank_stays"):
        if key in plan.meta:
            print(f"[plan] {plan.meta[key]}", file=sys.stderr, flush=True)
