"""Simulate policies over a whole length trace: the plans come from the planner, the rollouts from
`elastic.sim.simulate`, and the figures are summed over rollouts.

By default every epoch of the trace that has an earlier epoch is one rollout (its history is every
earlier epoch, `Trace.before`). `vanilla` is verl's placement with nobody leaving and needs no
planner; every other policy is `elastic.planning.planner.make_plan` with the layout it names, and `oracle` is
the planned layout given the true lengths (the bound a predictor could reach). A policy's
`objective` is the planner's chain criterion (`elastic.planning.chains.search.objective_key`): `occupied`, the
capacity-oriented default (fewest occupied rank-seconds), or `rollout`, the latency-oriented one
(shortest predicted rollout). It only matters where the group may shrink (natural, planned, oracle).
A policy's `ownership` is the planner's (`elastic.planning.dims.OWNERSHIPS`): `blocks` simulates
the megatron backend, whose stages can only be megatron-core's contiguous expert blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from elastic.ledger import STATES, Ledger, RankLedger
from elastic.planning.chains.search import objective_key
from elastic.planning.choices import PlanChoices
from elastic.planning.dims import OWNERSHIPS, planned_dims
from elastic.planning.lengths.remaining import OnlineOptions
from elastic.planning.memory.kv_unit import TOKENS, KVUnit
from elastic.planning.online.rule import OnlineRule, RuleConfig
from elastic.planning.plan import Plan
from elastic.planning.platform import Platform
from elastic.planning.policies import SIM_POLICIES as POLICIES
from elastic.planning.policies import PolicyKind, policy_kind
from elastic.planning.shape import ModelShape
from elastic.sim.costmodel import CostModel
from elastic.sim.simulate import SimConfig, SimulatedRollout, simulate_rollout
from elastic.trace import Trace, TraceError, TraceRecord


@dataclass(frozen=True)
class Policy:
    name: str
    floor: int
    tailguard: bool = False
    # The same planner given the true lengths (what `--compare` puts beside every policy).
    oracle: bool = False
    objective: str = "occupied"
    ownership: str = "balanced"
    # `adaptive` only: the evidence its online rule uses (the ablations switch parts off).
    online: OnlineOptions = OnlineOptions()

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {self.name!r}")
        objective_key(self.objective)  # a ValueError (PlanError) naming the objectives
        if self.ownership not in OWNERSHIPS:
            raise ValueError(f"ownership: expected one of {', '.join(OWNERSHIPS)}, got {self.ownership!r}")

    @property
    def choices(self) -> PlanChoices:
        """What it chooses for the planner beside its layout (`planner.make_plan`)."""
        return PlanChoices(self.floor, self.tailguard, self.objective)

    @property
    def kind(self) -> PolicyKind:
        return policy_kind(self.name)

    @property
    def shrinks(self) -> bool:
        """Whether the planner chooses a chain of stages for this policy (so `objective` matters)."""
        return self.kind.shrinks

    @property
    def label(self) -> str:
        if not self.kind.uses_planner:
            return self.name
        base = f"{self.name} floor{self.floor}" if self.shrinks else self.name
        # The default objective stays implicit, so the labels of the capacity rows do not change.
        suffix = f" [{self.objective}]" if self.shrinks and self.objective != "occupied" else ""
        suffix += " [blocks]" if self.shrinks and self.ownership == "blocks" else ""
        if self.kind.online:
            suffix = self.online.suffix + suffix
        return base + (" +TailGuard" if self.tailguard else "") + suffix


def rollout_epochs(trace: Trace) -> list[int]:
    """Every epoch with an earlier one (so the planner has history); a one-epoch trace is an error."""
    epochs = trace.epochs
    if len(epochs) < 2:
        raise TraceError(f"{trace.source}: simulating needs at least 2 epochs (history + rollout), "
                         f"found {len(epochs)}")
    return epochs[1:]


def make_policy_plan(policy: Policy, batch: list[TraceRecord], history: Trace, *, ranks: int,
                     shape: ModelShape, cost: CostModel,
                     known_prefix: dict[tuple[str, int], int] | None = None, kv: KVUnit = TOKENS) -> Plan:
    """The policy's plan (`policies.PolicyKind.plan`); the simulator ladders every `adaptive` plan.
    `known_prefix`: tokens so far of responses resumed from an earlier rollout (partial rollouts;
    their `prompt_len` counts them), planned by what is left of them. `kv`: how the simulated KV
    cache holds a request (`SimConfig.unit`), what the planner prices its memory check in."""
    # A simulated world need not divide the experts: balanced ownership holds uneven blocks or replicas.
    platform = Platform(planned_dims(ranks, shape.num_experts, policy.ownership), shape, cost,
                        replace(shape.budget, kv=kv))
    return policy.kind.plan(batch, history, platform=platform, choices=policy.choices, oracle=policy.oracle,
                            ladder_always=True, known_prefix=known_prefix)


def make_policy_rule(policy: Policy, plan: Plan, batch: list[TraceRecord], history: Trace, *,
                     shape: ModelShape, cost: CostModel, config: SimConfig,
                     known_prefix: dict[tuple[str, int], int] | None = None) -> OnlineRule | None:
    """The online rule of an `adaptive` plan (None for the other policies, which follow
    `Plan.advance`); `batch` in the order the simulator indexes responses. Its moves fit the
    receivers' KV and, as the engine's (`config.max_batch`, the runtime's `max_batch_per_rank`),
    their slots."""
    rule_config = RuleConfig(objective=policy.objective, check_every=config.check_every, max_batch=config.max_batch,
                             kv=config.unit)
    rule = policy.kind.rule(plan, batch, history, cost=cost, shape=shape, options=policy.online, config=rule_config,
                            known_prefix=known_prefix)
    if rule is not None:
        plan.meta["online"]["options"] = policy.online.suffix.strip() or "all"
    return rule


@dataclass
class TraceResult:
    policy: Policy
    ranks: int
    rollouts: list[SimulatedRollout] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    partial: dict | None = None  # partial rollouts' figures (`elastic.sim.partial`)

    def ledger(self) -> Ledger:
        """The rollouts' ledgers end to end: one ledger over the summed wall time."""
        w = self.ranks
        merged = [RankLedger(r) for r in range(w)]
        for res in self.rollouts:
            for r, rl in enumerate(res.ledger.ranks):
                for s in STATES:
                    merged[r].add(s, rl.seconds[s], rl.steps[s])
        return Ledger(merged, sum(r.ledger.wall_s for r in self.rollouts),
                      sum(r.ledger.total_steps for r in self.rollouts))

    def summary(self) -> dict:
        ledger = self.ledger()
        ledger.check()
        floor = self.plans[0].floor if self.plans else self.policy.floor
        out = {"policy": self.policy.name, "label": self.policy.label, "floor": floor,
               "tailguard": self.policy.tailguard, "objective": self.policy.objective,
               "ownership": self.policy.ownership, "rollouts": len(self.rollouts)}
        out.update(ledger.summary(sum(r.response_tokens for r in self.rollouts)))
        out["lower_bound_s"] = sum(r.lower_bound_s for r in self.rollouts)
        out["shrinks"] = sum(1 for r in self.rollouts for t in r.transitions if t[2] != 0)
        out["migrated_responses"] = sum(r.migrated for r in self.rollouts)
        if self.partial is not None:
            out["partial"] = dict(self.partial)
        peaks = [p for r in self.rollouts for p in (r.peak_concurrent or ())]
        if peaks:  # admission ran (`SimConfig.admits`, elastic/sim/admission.py)
            out["kv"] = {"peak_concurrent_per_rank": max(peaks),
                         "mean_peak_concurrent_per_rank": sum(peaks) / len(peaks)}
            if self.rollouts[0].max_batch is not None:
                out["kv"]["max_batch"] = self.rollouts[0].max_batch
        out["per_rollout"] = [
            {"rollout_time_s": r.ledger.wall_s, "lower_bound_s": r.lower_bound_s,
             "rank_seconds": r.ledger.rank_seconds(), "transitions": [list(t) for t in r.transitions],
             # What the planner expected of its plan, beside what the simulator found.
             "stage_sizes": [len(st.members) for st in p.stages],
             "planner_predicted_rollout_s": p.meta.get("predicted_rollout_s")}
            for r, p in zip(self.rollouts, self.plans)
        ]
        return out


def simulate_trace(trace: Trace, policy: Policy, *, ranks: int, cost: CostModel, shape: ModelShape,
                   config: SimConfig | None = None, epochs: list[int] | None = None) -> TraceResult:
    if shape.num_experts != cost.shape.num_experts:
        raise ValueError(f"model shape {shape.name!r} has {shape.num_experts} experts, "
                         f"cost model {cost.name!r} {cost.shape.num_experts}")
    result = TraceResult(policy, ranks)
    for e in epochs if epochs is not None else rollout_epochs(trace):
        batch = trace.epoch(e)
        config = config or SimConfig()
        plan = make_policy_plan(policy, batch, trace.before(e), ranks=ranks, shape=shape, cost=cost, kv=config.unit)
        rule = make_policy_rule(policy, plan, batch, trace.before(e), shape=shape, cost=cost, config=config)
        result.plans.append(plan)
        result.rollouts.append(simulate_rollout(plan, batch, cost, shape, config, rule))
    return result


def compare_policies(floors: tuple[int, ...] = (2, 4, 8), objective: str = "occupied",
                     ownership: str = "balanced") -> list[Policy]:
    """The side-by-side set of `--compare`: vanilla, lengthsort, natural and planned at every floor,
    each with and without TailGuard, natural and planned under `objective` and `ownership`."""
    out = [Policy("vanilla", 0)]
    for tg in (False, True):
        out.append(Policy("lengthsort", 0, tg))
    for name in ("natural", "planned"):
        for f in floors:
            for tg in (False, True):
                out.append(Policy(name, f, tg, objective=objective, ownership=ownership))
    return out


def decomposition(base: dict, other: dict) -> dict:
    """docs/design.md's split of the dummy run `other` removed against `base` (both summaries):
    vanilla dummy = rollout shortening W x (T_base - T) + coordinated exits (detached rank-s)
                    + dummy left + the rest (change of busy and transition rank-s)."""
    w = base["ranks"]
    shortening = w * (base["rollout_time_s"] - other["rollout_time_s"])
    exits = other["detached_rank_s"]
    left = other["rank_seconds"]["dummy"]
    return {"vanilla_dummy_rank_s": base["rank_seconds"]["dummy"], "rollout_shortening_rank_s": shortening,
            "coordinated_exits_rank_s": exits, "dummy_left_rank_s": left,
            "other_rank_s": base["rank_seconds"]["dummy"] - shortening - exits - left}
