"""`flexfloor simulate` (its flags: megatron_rl/cli/simulate.py, its config:
megatron_rl/cli/simulate_config.py): a length trace replayed on the cluster cost model under one
policy, or every policy side by side (`--compare`), printed, plotted and logged to W&B."""
from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict, replace

from elastic.planning.plan import PlanError
from elastic.sim.partial import simulate_partial
from elastic.sim.plot import write_plots
from elastic.sim.replay import Policy, compare_policies, rollout_epochs, simulate_trace
from elastic.sim.report import compare_table, run_compare, single_report
from elastic.trace import TraceError, read_trace
from megatron_rl.cli.simulate import FLAGS
from megatron_rl.cli.simulate_config import SimulateConfig
from megatron_rl.commands.outputs import check_plot_dir
from megatron_rl.commands.resolve import resolve
from megatron_rl.config import config_yaml, load_yaml
from megatron_rl.errors import FlexFloorError
from megatron_rl.metrics.keys import grouped, numeric
from megatron_rl.metrics.wandb_run import LoggingConfig, log_report, policy_tags


def resolve_simulate(args):
    """SimulateConfig from the flags, the `--cost` file (as `cost.*`) and `key=value` overrides."""
    extra = {f"cost.{k}": (v, f"{args.cost}: {k}") for k, v in (load_yaml(args.cost) if args.cost else {}).items()}
    if args.epochs:
        try:
            extra["epochs"] = ([int(x) for x in args.epochs.split(",")], f"--epochs {args.epochs}")
        except ValueError:
            raise FlexFloorError(f"--epochs: expected comma-separated integers, got {args.epochs!r}") from None
    return resolve(SimulateConfig, None, args, FLAGS, extra=extra)


def _setup(c):
    try:
        trace = read_trace(c.trace)
        if c.epochs is not None:
            bad = [e for e in c.epochs if e not in trace.epochs or e == trace.epochs[0]]
            if bad:
                raise FlexFloorError(f"--epochs: epoch {bad[0]} is not in {c.trace} or has no earlier epoch "
                                     f"(epochs: {trace.epochs})")
            epochs = c.epochs
        else:
            epochs = rollout_epochs(trace)
    except TraceError as e:
        raise FlexFloorError(str(e)) from None
    return trace, epochs, c.shape, c.cost, c.sim


def run(args) -> int:
    try:
        return _run(args)
    except PlanError as e:
        # The inputs admit no safe plan (floor too small for the experts, KV cannot fit, ...).
        raise FlexFloorError(f"planner: {e}") from None


def _run(args) -> int:
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
        plots = write_plots(results, args.plot)
        for path in plots:
            print(f"wrote {path}", file=sys.stderr)
    if args.wandb:
        _log_wandb(args, c, table, results, plots)
    return 0


def _compare(args, c, trace, epochs, shape, cost, config) -> tuple[list, list[dict]]:
    """`--compare`: every policy side by side, printed as a table (or JSON); (results to plot, rows)."""
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
    policy = Policy(c.policy, c.floor, c.tailguard, objective=c.objective,
                    ownership=c.dims.ownership)
    if c.partial.enabled:
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
    flat = [grouped(r) for r in table]
    nums = [numeric(f) for f in flat]
    columns = ["label", *sorted({k for n in nums for k in n})]
    rows = [[str(f.get("label", "")), *(n.get(k) for k in columns[1:])] for f, n in zip(flat, nums)]
    with tempfile.TemporaryDirectory() as tmp:
        if not plots:
            try:
                plots = write_plots(results, tmp)
            except ImportError:
                print("simulate: matplotlib is not installed; W&B gets no figures", file=sys.stderr)
        # The resolved config (flags, overrides, defaults), not the raw flags: an unset flag is None.
        logging = LoggingConfig(project=args.wandb, experiment=f"simulate-{c.ranks}ranks")
        folder = log_report(".", logging, job_type="simulate", config=vars(args) | asdict(c),
                            tags=policy_tags("compare" if args.compare else c.policy, c.floor),
                            metrics=nums[0], tables={"compare": (columns, rows)}, images=plots)
    if folder is not None:
        print(f"wandb: {folder}", file=sys.stderr)
