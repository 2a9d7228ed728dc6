"""`flexfloor simulate`: what a policy would do to a rollout on W H100s, from a length trace."""
from __future__ import annotations

import argparse

from elastic.planning.choices import OBJECTIVES
from elastic.planning.memory.kv_unit import KV_KINDS
from elastic.planning.policies import SIM_POLICIES
from megatron_rl.backend_rules import BACKENDS
from megatron_rl.cli.overrides import add_override_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate policies on a length trace with the cluster cost model",
        description="Replay a length trace on a simulated cluster: the planner's plans and the "
                    "runtime's shrink-trigger rule, with a cost model in place of GPUs. Every epoch "
                    "with an earlier epoch is one rollout; figures are summed over rollouts.",
    )
    p.add_argument("--trace", required=True, help="length trace (JSON Lines, see docs/design.md)")
    p.add_argument("--policy", choices=SIM_POLICIES,
                   help="adaptive: planned, then the online rule re-predicts, re-plans and migrates "
                        "stragglers at every check (docs/planner.md)")
    p.add_argument("--floor", type=int, help="fewest ranks the EP group may shrink to (default 4)")
    p.add_argument("--tailguard", action="store_true", default=None,
                   help="plan with TailGuard's calibrated upper bounds")
    p.add_argument("--objective", choices=OBJECTIVES,
                   help="how the planner picks the chain of stages: fewest occupied rank-seconds "
                        "(capacity, default) or shortest predicted rollout (latency)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="MoE backend the plans must suit: megatron (megatron-core's contiguous expert "
                        "blocks) allows only group sizes that divide the expert count (default torch)")
    p.add_argument("--ranks", type=int, help="ranks (accelerators) W (default 16)")
    p.add_argument("--model", default=None, help="model and hardware shape (elastic.planning.shape.SHAPES)")
    p.add_argument("--cost", default=None, metavar="YAML", help="cost-model fields to override (YAML mapping)")
    p.add_argument("--check-every", type=int, metavar="K",
                   help="decode steps between drain-status checks (default 16)")
    p.add_argument("--lease", action="store_true", default=None, help="detached ranks run side work under leases")
    p.add_argument("--migrate", type=int, metavar="N",
                   help="also simulate migrating the last N straggler responses a shrink waits for, "
                        "with their KV, to resident ranks, and report what that saves (a what-if for "
                        "the fixed plans; --policy adaptive migrates by its online rule, as the runtime does)")
    p.add_argument("--kv", choices=KV_KINDS,
                   help="how a rank admits requests into its KV budget: tokens (default: all at the "
                        "prefill, each at its real tokens), slots (one of the longest sequence each) or "
                        "paged (pages of kv_page_size=16 positions for each request's real length); the "
                        "plan's KV check and every move are priced the same way")
    p.add_argument("--max-batch", type=int, metavar="N",
                   help="a rank decodes at most N requests at once, the rest waiting first come first "
                        "served, under any --kv (the engine's max_batch_per_rank; default: no cap)")
    p.add_argument("--epochs", default=None, help="comma-separated epochs to simulate (default: all but the first)")
    p.add_argument("--partial", action="store_true", default=None,
                   help="partial rollouts: over-sample groups, end when one epoch's groups are complete, "
                        "carry the unfinished responses into the next rollout (partial.over_sample, "
                        "partial.end=budget partial.token_budget=N for Kimi's budget rule)")
    p.add_argument("--compare", action="store_true",
                   help="every policy side by side (floors 2, 4, 8; with and without TailGuard), each "
                        "beside its oracle and the lower bound, with the dummy-run decomposition")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures to DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--wandb", nargs="?", const="flexfloor", metavar="PROJECT",
                   help="log the summary (--compare: the table) and the figures (--plot, or made for "
                        "W&B when matplotlib is installed) to W&B project PROJECT (default flexfloor), "
                        "offline under ./wandb unless WANDB_MODE=online")
    add_override_args(p)


FLAGS = tuple((a, a) for a in ("trace", "policy", "floor", "tailguard", "objective", "backend", "ranks", "model",
                               "check_every", "lease", "migrate", "kv", "max_batch")) \
    + (("partial", "partial.enabled"),)
