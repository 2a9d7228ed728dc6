"""What `flexfloor simulate` simulates: its flags, `--cost` and `key=value` overrides in one dataclass.

Apart from cli/simulate.py because the cost model imports numpy, which `flexfloor --help` must not.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from elastic.planning.choices import OBJECTIVES
from elastic.planning.memory.kv_unit import KV_KINDS
from elastic.planning.policies import SIM_POLICIES
from elastic.planning.shape import SHAPES, ModelShape
from elastic.sim.costmodel import CostModel
from elastic.sim.simulate import SimConfig
from megatron_rl.backend_rules import BACKENDS
from megatron_rl.config import require
from megatron_rl.parallel.dims import parallel_dims, require_floor, require_policy
from megatron_rl.partial_config import PartialConfig


@dataclass
class SimulateConfig:
    trace: str = ""  # --trace is a required flag
    policy: Literal[SIM_POLICIES] = "planned"
    floor: int = 4
    tailguard: bool = False
    objective: Literal[OBJECTIVES] = "occupied"
    backend: Literal[BACKENDS] = "torch"
    ranks: int = 16
    model: str | None = None  # a name of elastic.planning.shape.SHAPES; None: cost.shape
    cost: CostModel = field(default_factory=CostModel)
    check_every: int = 16
    lease: bool = False
    migrate: int = 0
    epochs: list[int] | None = None  # default: every epoch that has an earlier one
    # KV admission (elastic/sim/admission.py): `tokens`, every request at the prefill; `slots` or
    # `paged` (pages of kv_page_size positions), each request as its rank's KV budget has room.
    kv: Literal[KV_KINDS] = "tokens"
    kv_page_size: int = 16
    # Requests one rank decodes at once, the rest waiting first come first served, under any `kv`
    # (the engine's max_batch_per_rank, e.g. 64); None: no cap.
    max_batch: int | None = None
    partial: PartialConfig = field(default_factory=PartialConfig)  # partial rollouts (elastic/sim/partial.py)

    def __post_init__(self):
        require(self.ranks >= 1, f"ranks: expected >= 1, got {self.ranks}")
        require_floor(self.floor, self.ranks)
        require(self.model is None or self.model in SHAPES,
                f"model: expected one of {', '.join(sorted(SHAPES))}, got {self.model!r}")
        if self.model is not None:  # the cost model prices the named shape
            require(self.cost.shape == ModelShape(), "cost.shape: expected --model or cost.shape fields, not both")
            named = self.cost.name != self.cost.shape.name  # else the name follows the shape
            self.cost = replace(self.cost, shape=SHAPES[self.model], name=self.cost.name if named else "")
        # The layout simulated, built once (not a field: `--print-config` prints the fields): a
        # simulated world need not divide the experts under the torch backend.
        self.dims = parallel_dims(self.ranks, self.shape.num_experts, self.backend,
                                  f"the experts of {self.shape.name}", even=False)
        require_policy(self.policy, self.backend)
        require(self.migrate >= 0, f"migrate: expected >= 0, got {self.migrate}")
        # Said here in the YAML's words (null); `SimConfig` checks it for Python callers (None).
        require(self.max_batch is None or self.max_batch >= 1,
                f"max_batch: expected >= 1 or null (no cap), got {self.max_batch}")
        # The simulator's own settings, built once and checked by `SimConfig` (not a field either).
        try:
            self.sim = SimConfig(check_every=self.check_every, lease=self.lease, kv=self.kv,
                                 kv_page_size=self.kv_page_size, max_batch=self.max_batch)
        except ValueError as e:
            require(False, str(e))

    @property
    def shape(self) -> ModelShape:
        return self.cost.shape
