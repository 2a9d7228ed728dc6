"""`flexfloor plan`: the planner's plan for one rollout of a length trace.

    flexfloor plan --trace dsr.jsonl --ranks 16 --floor 4 --tailguard --layout planned --json

The batch is the trace's epoch `--epoch` (default: the last one), planned from the epochs before
it only. `--json` prints the plan as one JSON object (`elastic.planning.plan.Plan.to_dict`); without it, a
summary: the quorum schedule, the per-rank load and the predicted release area.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from elastic.planning.choices import LAYOUTS, OBJECTIVES
from elastic.planning.shape import QWEN3_30B_A3B_H100, SHAPES
from megatron_rl.backend_rules import BACKENDS
from megatron_rl.cli.overrides import add_override_args
from megatron_rl.config import require, require_seed
from megatron_rl.parallel.dims import parallel_dims, require_floor

FLAGS = tuple((a, a) for a in ("trace", "epoch", "ranks", "floor", "layout", "tailguard", "alpha", "oracle",
                               "objective", "backend", "model", "max_response_len", "seed"))


@dataclass
class PlanConfig:
    """What `flexfloor plan` plans: its flags, or `key=value` overrides of these fields."""

    trace: str = ""  # --trace is a required flag
    epoch: int | None = None
    ranks: int = 16
    floor: int | None = None  # default: ranks (nobody leaves)
    layout: Literal[LAYOUTS] = "natural"
    tailguard: bool = False
    alpha: float = 0.05
    oracle: bool = False
    objective: Literal[OBJECTIVES] = "occupied"
    backend: Literal[BACKENDS] = "torch"
    model: str = QWEN3_30B_A3B_H100.name
    max_response_len: int | None = None
    seed: int = 0

    def __post_init__(self):
        require(self.model in SHAPES, f"model: expected one of {', '.join(sorted(SHAPES))}, got {self.model!r}")
        experts = SHAPES[self.model].num_experts
        require(self.ranks >= 1, f"ranks: expected >= 1, got {self.ranks}")
        require(self.ranks <= experts, f"ranks: expected at most the experts of {self.model} ({experts}: a "
                                       f"rank that owns no expert cannot take part), got {self.ranks}")
        if self.floor is not None:
            require_floor(self.floor, self.ranks)
        # The layout planned, built once (not a field: `--print-config` prints the fields): a
        # planned world need not divide the experts under the torch backend.
        self.dims = parallel_dims(self.ranks, experts, self.backend, f"the experts of {self.model}", even=False)
        require(0 < self.alpha < 1, f"alpha: expected in (0, 1), got {self.alpha}")
        require_seed(self.seed)
        require(self.epoch is None or self.epoch >= 0, f"epoch: expected >= 0, got {self.epoch}")
        require(self.max_response_len is None or self.max_response_len > 0,
                f"max_response_len: expected > 0 (a generation cap in tokens), got {self.max_response_len}")


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="plan one rollout of a length trace",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="length trace (JSON Lines, see docs/planner.md)")
    p.add_argument("--epoch", type=int, help="epoch to plan (default: the last)")
    p.add_argument("--ranks", type=int, help="ranks W (default: 16)")
    p.add_argument("--floor", type=int, help="fewest ranks the EP group may shrink to (default: W, nobody leaves)")
    p.add_argument("--layout", choices=LAYOUTS, help="default: natural")
    p.add_argument("--tailguard", action="store_true", default=None, help="size KV with TailGuard's bounds")
    p.add_argument("--alpha", type=float, help="TailGuard's target miss rate and the KV risk level (default: 0.05)")
    p.add_argument("--oracle", action="store_true", default=None, help="plan with the true lengths (the bound)")
    p.add_argument("--objective", choices=OBJECTIVES,
                   help="pick the chain with the fewest occupied rank-seconds (default) or the "
                        "shortest predicted rollout")
    p.add_argument("--backend", choices=BACKENDS,
                   help="MoE backend the plan must suit: megatron (megatron-core's contiguous expert "
                        "blocks) allows only group sizes that divide the expert count (default: torch)")
    p.add_argument("--model", choices=sorted(SHAPES),
                   help=f"model and hardware shape (default: {QWEN3_30B_A3B_H100.name})")
    p.add_argument("--max-response-len", type=int,
                   help="generation cap (default: inferred from truncated history records)")
    p.add_argument("--seed", type=int, help="seed of the planner's length samples (default: 0)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_override_args(p)
