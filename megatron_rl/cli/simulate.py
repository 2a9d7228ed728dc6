"""`flexfloor simulate`: what a policy would do to a rollout on W H100s, from a length trace."""
from __future__ import annotations

import argparse
import json
import sys

from megatron_rl.errors import FlexFloorError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate policies on a length trace with the cluster cost model",
        description="Replay a length trace on a simulated cluster: the planner's plans and the "
                    "runtime's shrink-trigger rule, with a cost model in place of GPUs. Every epoch "
                    "with an earlier epoch is one rollout; figures are summed over rollouts.",
    )
    p.add_argument("--trace", required=True, help="length trace (JSON Lines, see DESIGN.md)")
    p.add_argument("--policy", default="planned",
                   choices=["vanilla", "lengthsort", "natural", "planned", "oracle", "adaptive"],
                   help="adaptive: planned, then the online rule re-predicts, re-plans and migrates "
                        "stragglers at every check (docs/planner.md)")
    p.add_argument("--floor", type=int, default=4, help="fewest ranks the EP group may shrink to (default 4)")
    p.add_argument("--tailguard", action="store_true", help="plan with TailGuard's calibrated upper bounds")
    p.add_argument("--objective", default="occupied", choices=["occupied", "rollout"],
                   help="how the planner picks the chain of stages: fewest occupied rank-seconds "
                        "(capacity, default) or shortest predicted rollout (latency)")
    p.add_argument("--ranks", type=int, default=16, help="ranks (accelerators) W (default 16)")
    p.add_argument("--model", default=None, help="model and hardware shape (elastic.planning.shape.SHAPES)")
    p.add_argument("--cost", default=None, metavar="YAML", help="cost-model fields to override (YAML mapping)")
    p.add_argument("--check-every", type=int, default=16, metavar="K",
                   help="decode steps between drain-status checks (default 16)")
    p.add_argument("--lease", action="store_true", help="detached ranks run side work under leases")
    p.add_argument("--migrate", type=int, default=0, metavar="N",
                   help="also simulate migrating the last N straggler responses a shrink waits for, "
                        "with their KV, to resident ranks, and report what that saves (a what-if for "
                        "the fixed plans; --policy adaptive migrates by its online rule, as the runtime does)")
    p.add_argument("--epochs", default=None, help="comma-separated epochs to simulate (default: all but the first)")
    p.add_argument("--compare", action="store_true",
                   help="every policy side by side (floors 2, 4, 8; with and without TailGuard), each "
                        "beside its oracle and the lower bound, with the dummy-run decomposition")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures to DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _setup(args):
    from elastic.planning.shape import SHAPES, ModelShape
    from elastic.sim.costmodel import CostModel
    from elastic.sim.simulate import SimConfig
    from elastic.trace import TraceError, read_trace
    from megatron_rl.config import load_dataclass

    if args.ranks < 1:
        raise FlexFloorError(f"--ranks must be >= 1, got {args.ranks}")
    if not 1 <= args.floor <= args.ranks:
        raise FlexFloorError(f"--floor must be in 1..{args.ranks} (the ranks), got {args.floor}")
    if args.model is None:
        shape = ModelShape()
    elif args.model in SHAPES:
        shape = SHAPES[args.model]
    else:
        raise FlexFloorError(f"--model {args.model!r} is not known; known: {', '.join(sorted(SHAPES))}")
    cost = load_dataclass(CostModel, args.cost)
    if cost.num_experts != shape.num_experts:
        raise FlexFloorError(f"{args.cost or 'cost model'}: num_experts {cost.num_experts} differs from "
                             f"model {shape.name}'s {shape.num_experts}")
    try:
        config = SimConfig(check_every=args.check_every, lease=args.lease)
    except ValueError as e:
        raise FlexFloorError(f"--check-every: {e}") from None
    if args.migrate < 0:
        raise FlexFloorError(f"--migrate must be >= 0, got {args.migrate}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (in the dev extra, not a core dependency)
        except ImportError:
            raise FlexFloorError("--plot needs matplotlib: pip install matplotlib") from None
    try:
        trace = read_trace(args.trace)
        epochs = None
        if args.epochs:
            try:
                epochs = [int(x) for x in args.epochs.split(",")]
            except ValueError:
                raise FlexFloorError(f"--epochs: expected comma-separated integers, got {args.epochs!r}") from None
            bad = [e for e in epochs if e not in trace.epochs or e == trace.epochs[0]]
            if bad:
                raise FlexFloorError(f"--epochs: epoch {bad[0]} is not in {args.trace} or has no earlier epoch "
                                     f"(epochs: {trace.epochs})")
        else:
            from elastic.sim.replay import rollout_epochs
            epochs = rollout_epochs(trace)
    except TraceError as e:
        raise FlexFloorError(str(e)) from None
    return trace, epochs, shape, cost, config


def run(args) -> int:
    from elastic.planning.plan import PlanError

    try:
        return _run(args)
    except PlanError as e:
        # The inputs admit no safe plan (floor too small for the experts, KV cannot fit, ...).
        raise FlexFloorError(f"planner: {e}") from None


def _run(args) -> int:
    from dataclasses import replace

    from elastic.sim.replay import Policy, compare_policies, simulate_trace
    from elastic.sim.report import compare_table, run_compare, single_report

    trace, epochs, shape, cost, config = _setup(args)
    if args.compare:
        rows = run_compare(trace, ranks=args.ranks, cost=cost, shape=shape, config=config, epochs=epochs,
                           policies=compare_policies(objective=args.objective),
                           progress=lambda label: print(f"simulating {label} ...", file=sys.stderr, flush=True))
        if args.json:
            print(json.dumps({"ranks": args.ranks, "rollouts": len(epochs), "objective": args.objective,
                              "rows": rows}))
        else:
            print(compare_table(rows))
        results = [r["_result"] for r in rows] if args.plot else []
        for r in rows:
            r.pop("_result", None)
    else:
        policy = Policy(args.policy, args.floor, args.tailguard, objective=args.objective)
        result = simulate_trace(trace, policy, ranks=args.ranks, cost=cost, shape=shape, config=config,
                                epochs=epochs)
        summary = result.summary()
        if args.migrate:
            moved = simulate_trace(trace, policy, ranks=args.ranks, cost=cost, shape=shape,
                                   config=replace(config, migrate_max=args.migrate), epochs=epochs).summary()
            summary["migration"] = {
                "max_responses": args.migrate,
                "migrated_responses": moved["migrated_responses"],
                "rollout_time_s": moved["rollout_time_s"],
                "rollout_time_saved_s": summary["rollout_time_s"] - moved["rollout_time_s"],
                "detached_rank_s_gained": moved["detached_rank_s"] - summary["detached_rank_s"],
                "dummy_rank_s_saved": summary["rank_seconds"]["dummy"] - moved["rank_seconds"]["dummy"],
            }
        print(json.dumps(summary) if args.json else single_report(summary))
        results = [result]
    if args.plot:
        from elastic.sim.plot import write_plots

        for path in write_plots(results, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0
