"""Side-by-side comparison of simulated policies: every policy beside its oracle, the analytical
lower bound and vanilla, with docs/design.md's decomposition of the dummy run removed."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from elastic.ledger import format_report
from elastic.planning.policies import policy_kind
from elastic.planning.shape import ModelShape
from elastic.sim.costmodel import CostModel
from elastic.sim.replay import Policy, compare_policies, decomposition, simulate_trace
from elastic.sim.simulate import SimConfig
from elastic.trace import Trace


def _reduction(base: float, value: float) -> float:
    return (base - value) / base if base else 0.0


def run_compare(trace: Trace, *, ranks: int, cost: CostModel, shape: ModelShape, config: SimConfig,
                epochs: list[int] | None = None, policies: list[Policy] | None = None,
                progress: Callable[[str], None] | None = None) -> list[dict]:
    """One summary per policy (vanilla first), each with `oracle_rollout_time_s`, the reductions
    against vanilla and the decomposition; `_result` holds the `TraceResult` for plotting."""
    rows = []
    for policy in policies or compare_policies():
        if progress:
            progress(policy.label)
        res = simulate_trace(trace, policy, ranks=ranks, cost=cost, shape=shape, config=config, epochs=epochs)
        row = res.summary()
        row["_result"] = res
        if not policy.kind.uses_planner or policy.kind.oracle:
            # vanilla reads no prediction; oracle already is the true-length plan.
            row["oracle_rollout_time_s"] = row["rollout_time_s"]
        else:
            oracle = simulate_trace(trace, replace(policy, oracle=True),
                                    ranks=ranks, cost=cost, shape=shape, config=config, epochs=epochs)
            row["oracle_rollout_time_s"] = oracle.summary()["rollout_time_s"]
        rows.append(row)
    base = rows[0]
    if policy_kind(base["policy"]).uses_planner:
        raise ValueError(f"run_compare: expected vanilla (the baseline) as the first policy, got {base['policy']!r}")
    for row in rows:
        row["rollout_time_reduction"] = _reduction(base["rollout_time_s"], row["rollout_time_s"])
        row["dummy_reduction"] = _reduction(base["rank_seconds"]["dummy"], row["rank_seconds"]["dummy"])
        row["tokens_per_occupied_vs_vanilla"] = (row["tokens_per_occupied_rank_s"] / base["tokens_per_occupied_rank_s"]
                                                 if base["tokens_per_occupied_rank_s"] else 0.0)
        row["decomposition"] = decomposition(base, row)
    return rows


def compare_table(rows: list[dict]) -> str:
    """The text table of `run_compare` rows (markdown, so it pastes into docs)."""
    head = ("| policy | rollout s | vs vanilla | oracle s | lower bound s | dummy share | dummy cut "
            "| detached rank-s | tok/occupied rank-s | vs vanilla | shrinks |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['rollout_time_s']:.1f} | {0.0 - r['rollout_time_reduction']:+.2%} "
            f"| {r['oracle_rollout_time_s']:.1f} | {r['lower_bound_s']:.1f} | {r['dummy_share']:.2%} "
            f"| {r['dummy_reduction']:.2%} | {r['detached_rank_s']:.1f} | {r['tokens_per_occupied_rank_s']:.1f} "
            f"| {r['tokens_per_occupied_vs_vanilla']:.3f}x | {r['shrinks']} |"
        )
    lines.append("")
    lines.append("Dummy run removed against vanilla (rank-s): vanilla dummy = rollout shortening W x (T_base - T)"
                 " + coordinated exits (detached) + dummy left + other (busy/transition change)")
    lines.append("")
    lines.append("| policy | vanilla dummy | shortening | exits | left | other |")
    lines.append("|---|---|---|---|---|---|")
    for r in rows[1:]:
        d = r["decomposition"]
        lines.append(f"| {r['label']} | {d['vanilla_dummy_rank_s']:.1f} | {d['rollout_shortening_rank_s']:.1f} "
                     f"| {d['coordinated_exits_rank_s']:.1f} | {d['dummy_left_rank_s']:.1f} "
                     f"| {d['other_rank_s']:.1f} |")
    return "\n".join(lines)


def _partial_line(p: dict) -> str:
    figures = [f"{p['trained_groups']} groups trained", f"{p['carried']} responses carried over",
               f"off-policy tokens {p['off_policy_share']:.2%} (largest version lag {p['max_version_lag']})",
               f"{p['pending_groups_at_end']} groups pending after the last rollout", f"{p['dropped']} dropped"]
    return f"partial rollouts ({p['rule']}): " + ", ".join(figures)


def single_report(summary: dict) -> str:
    """`flexfloor simulate` without --json: the ledger table plus the distance to the bound."""
    lines = [f"policy {summary['label']} on {summary['ranks']} ranks, {summary['rollouts']} rollout(s), summed:",
             format_report(summary),
             (f"lower bound {summary['lower_bound_s']:.2f} s "
             f"(rollout time is {summary['rollout_time_s'] / summary['lower_bound_s']:.2f}x it); "
             f"{summary['shrinks']} shrinks, {summary['detached_rank_s']:.1f} detached rank-s")]
    if summary.get("partial"):
        lines.append(_partial_line(summary["partial"]))
    kv = summary.get("kv")
    if kv:
        cap = f", cap max_batch={kv['max_batch']}" if "max_batch" in kv else ""
        lines.append(f"KV admission: at most {kv['peak_concurrent_per_rank']} requests decoding at once "
                     f"per rank (mean peak {kv['mean_peak_concurrent_per_rank']:.1f}{cap})")
    mig = summary.get("migration")
    if mig:
        lines.append(f"KV migration (up to {mig['max_responses']} stragglers per shrink): {mig['migrated_responses']} "
                     f"responses moved, rollout time {-mig['rollout_time_saved_s']:+.2f} s, "
                     f"dummy {-mig['dummy_rank_s_saved']:+.1f} rank-s, "
                     f"detached {mig['detached_rank_s_gained']:+.1f} rank-s")
    return "\n".join(lines)
