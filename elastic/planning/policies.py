"""The rollout policies, named and defined once: the CLI's choices, the configs' fields, the rank
rollout's plan (`megatron_rl/rollout/rollout_plan.py`) and the simulator's (`elastic/sim/replay.py`)
all ask the `PolicyKind` of a name, so the two cannot drift apart.

- `vanilla`: one stage, nobody leaves; `lengthsort`: responses sorted by predicted length, nobody leaves;
- `natural` / `planned`: the EP group shrinks to the floor (in arrival order / on predicted lengths);
- `adaptive`: planned, then the online rule re-predicts, re-plans and migrates stragglers; its
  ladder of stages needs `balanced` expert ownership (the torch backend);
- `oracle` (simulator only): planned on the true lengths, a bound beside the policies.

The layouts, the planner and the online rule import numpy: they are imported where a plan is made,
so that reading a policy's name (`flexfloor --help`, a config's check) imports no numpy.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from elastic.planning.choices import PlanChoices
from elastic.planning.dims import OWNERSHIPS
from elastic.planning.online.ladder import ladder_plan
from elastic.planning.plan import Plan, static_plan

if TYPE_CHECKING:  # numpy's modules, named here for the annotations only (module docstring)
    from elastic.planning.online.rule import RuleConfig
    from elastic.planning.platform import Platform

POLICIES = ("vanilla", "lengthsort", "natural", "planned", "adaptive")
SIM_POLICIES = ("vanilla", "lengthsort", "natural", "planned", "oracle", "adaptive")


class PolicyError(ValueError):
    """A policy asked to run where it cannot (one line at the CLI)."""


def default_floor(ranks: int) -> int:
    """The floor a shrinking policy plans down to when the command names none: half the ranks."""
    return max(1, ranks // 2)


@dataclass(frozen=True)
class PolicyKind:
    name: str
    layout: str | None  # the planner's layout; None: no planner (natural placement, one stage)
    shrinks: bool  # whether the planner chooses a chain of stages down to the floor
    oracle: bool = False  # planned on the true lengths
    online: bool = False  # an online rule re-predicts, re-plans and migrates during the rollout
    ownerships: tuple[str, ...] = OWNERSHIPS  # the expert ownerships it can run under

    def floor(self, ranks: int, floor: int | None) -> int:
        """The floor it plans to: every rank if it never shrinks, else `floor` (`default_floor` if None)."""
        return (floor or default_floor(ranks)) if self.shrinks else ranks

    @property
    def uses_planner(self) -> bool:
        """False for the baseline that places in arrival order with nobody leaving (`vanilla`)."""
        return self.layout is not None

    def check_ownership(self, ownership: str) -> None:
        """Raise PolicyError unless it can run under the expert `ownership` (a backend's)."""
        if ownership not in self.ownerships:
            raise PolicyError("its ladder of stages needs arbitrary expert ownership (backend torch); "
                              "megatron-core holds only contiguous blocks")

    def plan(self, batch, history, *, platform: Platform, choices: PlanChoices, oracle: bool = False,
             ladder_always: bool = False, max_response_len: int | None = None, known_prefix: dict | None = None):
        """The plan of one rollout of `batch` on `platform` with the run's `choices` (`choices.floor`
        None: this policy's default), by `planner.make_plan` (`max_response_len`, `known_prefix`:
        its own); `oracle` plans on the true lengths (`response_len`) whatever the policy. An online
        policy's plan is the ladder of every candidate stage (`online.ladder.ladder_plan`); where the
        offline plan keeps every rank a rank rollout takes the vanilla path instead: vanilla's plan
        (its natural layout, its owners; no ladder, no online rule), the offline plan's meta kept,
        while the simulator, `ladder_always`, still ladders it."""
        # Deferred: numpy (module docstring).
        from elastic.planning.layout import natural
        from elastic.planning.planner import make_plan

        dims = platform.dims

        def vanilla() -> Plan:  # vanilla's plan: the natural layout, one stage
            return static_plan("natural", natural([(b.prompt_id, b.sample) for b in batch], dims.world),
                               dims.world, dims.experts)

        if not self.uses_planner:
            return vanilla()
        self.check_ownership(dims.ownership)
        choices = replace(choices, floor=self.floor(dims.world, choices.floor))
        true = {(b.prompt_id, b.sample): b.response_len for b in batch} if oracle or self.oracle else None
        plan = make_plan(batch, history, platform=platform, layout=self.layout, choices=choices, true_lengths=true,
                         max_response_len=max_response_len, known_prefix=known_prefix)
        if self.online and (ladder_always or len(plan.stages) > 1):
            return ladder_plan(plan, choices.floor)
        if self.online:
            # The planned layout places by predicted length for chains that shrink; where nobody
            # leaves it won nothing and cost 5-7% more rollout time than vanilla's layout on
            # tiny_cpu_grpo.yaml (tools/bench_train_elastic.py, 2026-12-07).
            return replace(vanilla(), meta={**plan.meta, "effective_layout": "natural"})
        return plan

    def rule(self, plan, batch, history, *, cost, shape, options, config: RuleConfig,
             max_response_len: int | None = None, known_prefix: dict | None = None):
        """The online rule of a laddered plan (`online.rule.OnlineRule`, `config` its own), or None:
        the other policies follow `Plan.advance`. `batch` in the order the rule indexes responses;
        `options` (`online.OnlineOptions`) the evidence it uses; `max_response_len` bounds lengths
        when the plan's predictor learnt no cap."""
        if not self.online or "ladder" not in plan.meta:
            return None
        # Deferred: numpy (module docstring).
        from elastic.planning.lengths.remaining import online_model
        from elastic.planning.online.rule import OnlineRule

        predictor = plan.meta["predictor"]  # "oracle" when started from the true-length plan
        cap = predictor["cap"] if isinstance(predictor, dict) else None
        model = online_model(batch, history, cap or max_response_len, options, known_prefix)
        plan.meta["online"] = {"siblings": model.fit.to_dict()}
        return OnlineRule(plan, [r.prompt_len for r in batch], model, cost, shape, config)


_POLICY_KINDS = {k.name: k for k in (
    PolicyKind("vanilla", None, shrinks=False),
    PolicyKind("lengthsort", "lengthsort", shrinks=False),
    PolicyKind("natural", "natural", shrinks=True),
    PolicyKind("planned", "planned", shrinks=True),
    PolicyKind("oracle", "planned", shrinks=True, oracle=True),
    PolicyKind("adaptive", "planned", shrinks=True, online=True, ownerships=("balanced",)),
)}


def policy_kind(name: str) -> PolicyKind:
    """The policy `name` (one of `SIM_POLICIES`)."""
    if name not in _POLICY_KINDS:
        raise PolicyError(f"policy: expected one of {', '.join(SIM_POLICIES)}, got {name!r}")
    return _POLICY_KINDS[name]
