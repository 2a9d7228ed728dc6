"""`flexfloor simulate`: what a policy would do to a rollout on W H100s, from a length trace."""
from __future__ import annotations

import argparse
import json
import sys

from elastic.planning.choices import OBJECTIVES
from elastic.planning.memory.kv_unit import KV_KINDS
from elastic.planning.policies import SIM_POLICIES
from megatron_rl.backend_rules import BACKENDS
from megatron_rl.errors import FlexFloorError


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
    from megatron_rl.cli.overrides import add_override_args

    add_override_args(p)
    p.set_defaults(func=run)


FLAGS = tuple((a, a) for a in ("trace", "policy", "floor", "tailguard", "objective", "backend", "ranks", "model",
                               "check_every", "lease", "migrate", "kv", "max_batch")) \
    + (("partial", "partial.enabled"),)


def resolve_simulate(args):
    """SimulateConfig from the flags, the `--cost` file (as `cost.*`) and `key=value` overrides."""
    from megatron_rl.cli.overrides import resolve
    from megatron_rl.cli.simulate_config import SimulateConfig
    from megatron_rl.config import load_yaml

    extra = {f"cost.{k}": (v, f"{args.cost}: {k}") for k, v in (load_yaml(args.cost) if args.cost else {}).items()}
    if args.epochs:
        try:
            extra["epochs"] = ([int(x) for x in args.epochs.split(",")], f"--epochs {args.epochs}")
        except ValueError:
            raise FlexFloorError(f"--epochs: expected comma-separated integers, got {args.epochs!r}") from None
    return resolve(SimulateConfig, None, args, FLAGS, extra=extra)


def _setup(c):
    from elastic.trace import TraceError, read_trace

    try:
        trace = read_trace(c.trace)
        if c.epochs is not None:
            bad = [e for e in c.epochs if e not in trace.epochs or e == trace.epochs[0]]
            if bad:
                raise FlexFloorError(f"--epochs: epoch {bad[0]} is not in {c.trace} or has no earlier epoch "
                                     f"(epochs: {trace.epochs})")
            epochs = c.epochs
        else:
            from elastic.sim.replay import rollout_epochs
            epochs = rollout_epochs(trace)
    except TraceError as e:
        raise FlexFloorError(str(e)) from None
    return trace, epochs, c.shape, c.cost, c.sim


def run(args) -> int:
    from elastic.planning.plan import PlanError

    try:
        return _run(args)
    except PlanError as e:
        # The inputs admit no safe plan (floor too small for the experts, KV cannot fit, ...).
        raise FlexFloorError(f"planner: {e}") from None


def _run(args) -> int:
    from dataclasses import replace

    from megatron_rl.cli.outputs import check_plot_dir
    from megatron_rl.config import config_yaml

    c = resolve_simulate(args)
    if args.print_config:
        print(config_yaml(c), end="")
        return 0
    check_plot_dir(args.plot)
    trace, epochs, shape, cost, config = _setup(c)
    if args.plot or args.wandb:  # the figures include each policy's per-rank timeline
        config = replace(config, timeline=True)
    if c.partial.enabled and (args.compare or c.migrate):
        raise FlexFloorError("--partial: one policy at a time, without --compare or --migrate "
                             "(tools/bench_partial.py compares partial rollouts side by side)")
    run_one = _compare if args.compare else _single
    results, table = run_one(args, c, trace, epochs, shape, cost, config)
    plots = []
    if args.plot:
        from elastic.sim.plot import write_plots

        plots = write_plots(results, args.plot)
        for path in plots:
            print(f"wrote {path}", file=sys.stderr)
    if args.wandb:
        _log_wandb(args, c, table, results, plots)
    return 0


def _compare(args, c, trace, epochs, shape, cost, config) -> tuple[list, list[dict]]:
    """`--compare`: every policy side by side, printed as a table (or JSON); (results to plot, rows)."""
    from elastic.sim.replay import compare_policies
    from elastic.sim.report import compare_table, run_compare

    rows = run_compare(trace, ranks=c.ranks, cost=cost, shape=shape, config=config, epochs=epochs,
                       policies=compare_policies(objective=c.objective,
                                                 ownership=c.dims.ownership),
                       progress=lambda label: print(f"simulating {label} ...", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps({"ranks": c.ranks, "rollouts": len(epochs), "objective": c.objective,
                          "rows": rows}))
    else:
        print(compare_table(rows))
    results = [r["_result"] for r in rows] if args.plot or args.wandb else []
    for r in rows:
        r.pop("_result", None)
    return results, rows


def _single(args, c, trace, epochs, shape, cost, config) -> tuple[list, list[dict]]:
    """One policy (`--partial`: its partial rollouts), with the `--migrate` what-if beside it;
    printed as a report (or JSON); (results to plot, its one row)."""
    from dataclasses import replace

    from elastic.sim.replay import Policy, simulate_trace
    from elastic.sim.report import single_report

    policy = Policy(c.policy, c.floor, c.tailguard, objective=c.objective,
                    ownership=c.dims.ownership)
    if c.partial.enabled:
        from elastic.sim.partial import simulate_partial

        result = simulate_partial(trace, policy, c.partial.rule(), ranks=c.ranks, cost=cost, shape=shape,
                                  config=config, epochs=epochs)
    else:
        result = simulate_trace(trace, policy, ranks=c.ranks, cost=cost, shape=shape, config=config,
                                epochs=epochs)
    summary = result.summary()
    if c.migrate:
        moved = simulate_trace(trace, policy, ranks=c.ranks, cost=cost, shape=shape,
                               config=replace(config, migrate_max=c.migrate), epochs=epochs).summary()
        summary["migration"] = {
            "max_responses": c.migrate,
            "migrated_responses": moved["migrated_responses"],
            "rollout_time_s": moved["rollout_time_s"],
            "rollout_time_saved_s": summary["rollout_time_s"] - moved["rollout_time_s"],
            "detached_rank_s_gained": moved["detached_rank_s"] - summary["detached_rank_s"],
            "dummy_rank_s_saved": summary["rank_seconds"]["dummy"] - moved["rank_seconds"]["dummy"],
        }
    print(json.dumps(summary) if args.json else single_report(summary))
    return [result], [{"label": c.policy, **summary}]


def _log_wandb(args, c, table: list[dict], results: list, plots: list) -> None:
    """One W&B run: the first row's numbers as metrics, every row as a W&B table, the figures."""
    import tempfile
    from dataclasses import asdict

    from megatron_rl.metrics.keys import grouped, numeric
    from megatron_rl.metrics.wandb_run import LoggingConfig, log_report, policy_tags

    flat = [grouped(r) for r in table]
    nums = [numeric(f) for f in flat]
    columns = ["label", *sorted({k for n in nums for k in n})]
    rows = [[str(f.get("label", "")), *(n.get(k) for k in columns[1:])] for f, n in zip(flat, nums)]
    with tempfile.TemporaryDirectory() as tmp:
        if not plots:
            try:
                from elastic.sim.plot import write_plots

                plots = write_plots(results, tmp)
            except ImportError:
                print("simulate: matplotlib is not installed; W&B gets no figures", file=sys.stderr)
        # The resolved config (flags, overrides, defaults), not the raw flags: an unset flag is None.
        logging = LoggingConfig(project=args.wandb, experiment=f"simulate-{c.ranks}ranks")
        folder = log_report(".", logging, job_type="simulate", config=vars(args) | asdict(c) | {"func": None},
                            tags=policy_tags("compare" if args.compare else c.policy, c.floor),
                            metrics=nums[0], tables={"compare": (columns, rows)}, images=plots)
    if folder is not None:
        print(f"wandb: {folder}", file=sys.stderr)
