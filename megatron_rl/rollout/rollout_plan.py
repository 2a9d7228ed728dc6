"""The plan of one rollout, as both `flexfloor rollout` and `train` ask for it: the model's config
(a checkpoint's headers checked before any rank starts), the plan of a policy with the model's shape
it was priced on, and the online rule of an `adaptive` plan; `RolloutSetup` builds them once for
`flexfloor rollout`, with its device and memory budget. The rank rollout (`rank_rollout.py`) carries
the plan out.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from elastic.planning.dims import ParallelDims
from elastic.planning.kv_unit import TOKENS, KVUnit
from elastic.planning.plan import Plan
from elastic.planning.policies import PolicyError, policy_kind
from elastic.planning.shape import MemoryBudget, ModelShape
from megatron_rl.errors import FlexFloorError
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.qwen3_moe import DTYPES
from megatron_rl.parallel.device import resolve_device
from megatron_rl.parallel.dims import parallel_dims
from megatron_rl.parallel.launch import driver_process
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
    from megatron_rl.models.hf import check_hf_checkpoint, check_same_shape

    if cfg.model != MoEModelConfig():
        check_same_shape(cfg.checkpoint, cfg.model, where="model:")
    mcfg = check_hf_checkpoint(cfg.checkpoint)
    return mcfg, parallel_dims(cfg.ranks, mcfg.num_moe_experts, cfg.backend, f"num_experts of {cfg.checkpoint}")


@dataclass(frozen=True)
class RolloutSetup:
    """What `flexfloor rollout` decides before any rank starts, each once: the device its ranks
    compute on, the model's shape priced against that device's memory, the plan, and the online
    rule of an `adaptive` plan (None otherwise)."""

    plan: Plan
    rule: object | None
    shape: ModelShape
    device: str

    @classmethod
    def build(cls, cfg: RolloutConfig, mcfg: MoEModelConfig, dims: ParallelDims, batch, history,
              device: str | None = None) -> RolloutSetup:
        """`mcfg`, `dims`: `model_config`'s; `device`: the config's resolved device where the caller
        has it (`resolve_device`)."""
        device = device or resolve_device(cfg.device)
        # Every rank computes on that device; one GPU (or this host's RAM over the ranks on it)
        # stands for each rank's budget.
        budget = memory_budget(mcfg, DTYPES[cfg.dtype].itemsize, torch.device(device), dims.ranks_per_node,
                               kv=cfg.kv_kind.unit)
        plan, shape = plan_rollout(batch, history, policy=cfg.policy, dims=dims, floor=cfg.floor,
                                   tailguard=cfg.tailguard, mcfg=mcfg, dtype_bytes=DTYPES[cfg.dtype].itemsize,
                                   budget=budget, length_scale=cfg.batch.length_scale, device=device,
                                   # A replayed response has its traced length: with no earlier epoch to
                                   # learn a cap from, that is the bound on its KV (a one-epoch trace).
                                   max_response_len=None if len(history) else max(r.response_len for r in batch))
        if driver_process():
            say_plan_notes(plan)
        rule = online_rule(plan, batch, history, policy=cfg.policy, shape=shape, status_interval=cfg.status_interval,
                           max_batch=cfg.max_batch_per_rank, length_scale=cfg.batch.length_scale, kv=budget.kv)
        return cls(plan, rule, shape, device)


def say_plan_notes(plan: Plan) -> None:
    """What the planner decided that a user would not guess, on stderr; the caller says it once
    per run, not once per rank: a raised floor, and why a shrinking policy keeps every rank."""
    for key in ("floor_raised", "kv_queued", "every_rank_stays"):
        if key in plan.meta:
            print(f"[plan] {plan.meta[key]}", file=sys.stderr, flush=True)


def plan_rollout(batch, history, *, policy: str, dims: ParallelDims, floor: int | None, tailguard: bool,
                 mcfg: MoEModelConfig, dtype_bytes: int, budget: MemoryBudget,
                 max_response_len: int | None = None, shrink_cost_s: float | None = None,
                 length_scale: float = 1.0, device: str = "cpu",
                 known_prefix: dict | None = None) -> tuple[Plan, ModelShape]:
    """The plan of one rollout under `policy` on the command's layout `dims` (its ranks and the
    backend's expert ownership, `megatron_rl.parallel.dims.parallel_dims`), its memory checks priced
    against `budget` (`rollout/memory.py`); `max_response_len` bounds KV when history is empty. On
    CPU, chains are priced on this CPU engine's measured step and shrink (`engine_cost`, the run
    decoding `length_scale` of each trace length); on GPU on the shape's cost model; `shrink_cost_s`
    instead prices a shrink at that fixed cost on the shape's model. When a shrinking policy keeps
    every rank, stderr says why. `known_prefix`: tokens so far of resumed responses (partial
    rollouts, `make_plan`'s). Returns the plan and the model's shape it was priced on."""
    from elastic.planning.planner import PlanError
    from elastic.planning.step_cost import ShapeCost

    kind, W = policy_kind(policy), dims.world
    floor = kind.floor(W, floor)
    shape = mcfg.shape(dtype_bytes, budget, ranks_per_node=dims.ranks_per_node)
    if shrink_cost_s is not None:
        cost = ShapeCost(shape, shrink_fixed_s=shrink_cost_s)
    else:
        cost = engine_cost(length_scale) if device == "cpu" else ShapeCost(shape)
    try:
        # A plan that keeps every rank predicts no gain: `adaptive` then takes the vanilla path too (one
        # stage, no online rule: no per-response status collective, no re-planning, no ladder's groups).
        plan = kind.plan(batch, history, dims=dims, floor=floor, shape=shape, cost=cost, tailguard=tailguard,
                         max_response_len=max_response_len, budget=budget, known_prefix=known_prefix)
    except PolicyError as e:
        raise FlexFloorError(f"policy {policy}: {e}") from None
    except PlanError as e:
        raise FlexFloorError(f"planner: {e}") from None
    if len(plan.stages) == 1 and floor < W and "kv_queued" not in plan.meta:
        m = plan.meta
        m["every_rank_stays"] = (
            f"{policy} floor {floor}: every rank stays{' (the vanilla path)' if kind.online else ''}: "
            f"of {m['chains_priced']} chains priced "
            f"({m['chains_feasible']} fit the KV cache), keeping all {W} ranks has the fewest predicted "
            f"occupied rank-seconds ({m['predicted_occupied_rank_s']:.3g}; rollout "
            f"{m['predicted_rollout_s']:.3g} s, a shrink {cost.shrink_s(1, W):.3g} s)")
    return plan, shape


def online_rule(plan: Plan, batch, history, *, policy: str, shape: ModelShape, status_interval: int,
                max_batch: int, length_scale: float = 1.0, max_response_len: int | None = None,
                migrate: bool = True, known_prefix: dict | None = None, kv: KVUnit = TOKENS):
    """The online rule of an `adaptive` plan, priced on this engine (`engine_cost`), or None for
    the other policies and for a plan that keeps every rank (`plan_rollout`: the vanilla path);
    `batch` in `plan.assignments` order. It reasons in trace tokens: the driver divides the run's
    by `length_scale`. On this engine a step costs the same in any group, so a shrink can only
    lengthen the rollout: the rule runs without its latency guard and, like `planned`, shrinks
    when the objective's occupied rank-seconds say it pays. `kv`: how the run's KV cache holds a
    request (the memory budget's), what the rule checks its moves' receivers in."""
    from elastic.planning.remaining import OnlineOptions

    rule = policy_kind(policy).rule(plan, batch, history, cost=engine_cost(length_scale), shape=shape,
                                    options=OnlineOptions(migrate=migrate), max_response_len=max_response_len,
                                    known_prefix=known_prefix, max_slowdown=None, max_batch=max_batch,
                                    check_every=max(1, round(status_interval / length_scale)), kv=kv)
    if rule is not None:
        plan.meta["online"]["migrate"] = migrate
    return rule

