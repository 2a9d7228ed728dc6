"""Partial rollouts beside the synchronous elastic one, in the simulator, on the same traces.

    python tools/bench_partial.py                        # the three presets, printed
    python tools/bench_partial.py --write docs/reproduction.md   # and its section replaced there
    python tools/bench_partial.py --traces held-out --rollouts 3  # traces no constant was chosen on

Per trace, four policies side by side (16 ranks, floor 4, TailGuard, objective `rollout` for the
adaptive rows, drain checks every 16 steps): `vanilla` (synchronous, nobody leaves), `partial`
(vanilla's placement with partial rollouts: APRIL-like), `adaptive` (synchronous, online
re-planning and KV migration) and `adaptive + partial`. Partial rollouts use the `groups` end rule
with over_sample 0.25 (`elastic.planning.partial`); every run trains the same groups per rollout
(one epoch's). Each trace has one epoch beyond the rollouts, so the last rollouts can over-sample
too (the synchronous runs never read it). Columns: rollout time summed over rollouts, dummy share,
response tokens per occupied rank-second, the response tokens trained against vanilla's (partial
rollouts train the long groups later: fewer of them in the same rollouts), off-policy token share
(trained tokens sampled by an older policy than the one trained), the largest version lag,
responses carried over (summed over rollouts), groups still pending after the last rollout (not
lost: they would train next).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.planning.partial import PartialRule
from elastic.planning.shape import ModelShape
from elastic.sim.costmodel import CostModel
from elastic.sim.partial import simulate_partial
from elastic.sim.replay import Policy, simulate_trace
from elastic.sim.simulate import SimConfig
from elastic.sim.synth import generate, preset

PRESETS = {"deepscaler": ("DeepScaleR-like math", "deepscaler", {}),
           "eurus": ("Eurus-like code", "eurus", {}),
           "nosignal": ("no-signal", "nosignal", {})}
# The held-out variants of tools/bench_adaptive.py (the presets with their parameters moved).
HELD_OUT = {"weak": ("weak (held out)", "deepscaler", {"prompt_share": 0.35, "drift": 0.06}),
            "wide": ("wide (held out)", "deepscaler", {"sigma": 1.0, "hard_share": 0.25, "hard_factor": 4.0}),
            "short": ("short (held out)", "eurus", {"median": 450.0, "cap": 2048}),
            "growing": ("growing (held out)", "deepscaler", {"trend": 0.08, "median": 1500.0}),
            "flat": ("flat (held out)", "nosignal", {"sigma": 0.5})}
TRACES = {**PRESETS, **HELD_OUT}
RANKS, FLOOR = 16, 4
RULE = PartialRule(over_sample=0.25, end="groups")
BEGIN, END = "<!-- bench_partial:begin -->", "<!-- bench_partial:end -->"


ABLATION = "adaptive + partial, tokens so far hidden"


def policies(ablation: bool = False):
    """(label, policy, partial rule or None) in table order; with `ablation`, adaptive + partial
    with the resumed responses' tokens so far hidden from the planner and the online rule."""
    adaptive = Policy("adaptive", FLOOR, True, objective="rollout")
    rows = [("vanilla", Policy("vanilla", RANKS), None), ("partial", Policy("vanilla", RANKS), RULE),
            ("adaptive", adaptive, None), ("adaptive + partial", adaptive, RULE)]
    return rows + ([(ABLATION, adaptive, RULE)] if ablation else [])


def run_trace(name: str, rollouts: int, seed: int, cost: CostModel, shape: ModelShape,
              config: SimConfig, ablation: bool = False) -> list[dict]:
    _, base, kw = TRACES[name]
    trace = generate(preset(base, epochs=rollouts + 2, **kw), seed=seed)
    epochs = trace.epochs[1:rollouts + 1]
    rows = []
    for label, pol, rule in policies(ablation):
        t0 = time.perf_counter()
        if rule is None:
            res = simulate_trace(trace, pol, ranks=RANKS, cost=cost, shape=shape, config=config, epochs=epochs)
        else:
            res = simulate_partial(trace, pol, rule, ranks=RANKS, cost=cost, shape=shape, config=config,
                                   epochs=epochs, tell_prefix=label != ABLATION)
        s = res.summary()
        s["row"], s["sim_s"] = label, time.perf_counter() - t0
        rows.append(s)
        print(f"    {name}: {label} {s['rollout_time_s']:.1f} s ({s['sim_s']:.0f} s to simulate)",
              file=sys.stderr, flush=True)
    return rows


def table(results: dict[str, list[dict]]) -> list[str]:
    out = ["| trace | policy | rollout s | vs vanilla | dummy share | tok/occupied rank-s | trained tokens vs vanilla "
           "| off-policy tokens | max lag | carried over | pending at end |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        van = rows[0]
        for s in rows:
            p = s.get("partial") or {}
            out.append(f"| {TRACES[name][0]} | {s['row']} | {s['rollout_time_s']:.1f} "
                       f"| {s['rollout_time_s'] / van['rollout_time_s'] - 1:+.2%} | {s['dummy_share']:.2%} "
                       f"| {s['tokens_per_occupied_rank_s']:.1f} "
                       f"| {p.get('trained_tokens', s['response_tokens']) / van['response_tokens']:.3f}x "
                       f"| {p.get('off_policy_share', 0.0):.2%} "
                       f"| {p.get('max_version_lag', 0)} | {p.get('carried', 0)} "
                       f"| {p.get('pending_groups_at_end', 0)} |")
    return out


def differences(results: dict[str, list[dict]]) -> list[str]:
    """adaptive + partial against partial alone, per trace (the issue's acceptance figure)."""
    out = []
    for name, rows in results.items():
        by = {s["row"]: s for s in rows}
        a, p = by["adaptive + partial"], by["partial"]
        dt = a["rollout_time_s"] / p["rollout_time_s"] - 1
        ds = a["partial"]["off_policy_share"] - p["partial"]["off_policy_share"]
        verdict = "faster at an equal or lower off-policy share" if dt < 0 and ds <= 0 else "NOT faster at <= share"
        out.append(f"- {TRACES[name][0]}: adaptive + partial {dt:+.2%} rollout time against partial alone, "
                   f"off-policy token share {ds * 100:+.2f} points ({verdict}).")
    return out


def section(results: dict[str, list[dict]], rollouts: int, seed: int) -> list[str]:
    return [BEGIN, "## Partial rollouts beside the elastic one", "",
            (f"Generated by `python tools/bench_partial.py --write docs/reproduction.md` (seed {seed}, "
             f"{rollouts} rollouts per trace; `tools/reproduction_report.py` keeps this section as it is). "
             f"{RANKS} ranks; `adaptive` is floor {FLOOR} + TailGuard with objective `rollout`; partial "
             f"rollouts {RULE.describe} (the `groups` rule), every run training one epoch's groups per "
             "rollout. *off-policy tokens*: share of trained tokens sampled by an older policy than the one "
             "trained; *carried over*: responses unfinished at a rollout's end, summed; *pending at end*: "
             "groups launched but not yet trained after the last rollout (kept, not lost: no response was "
             "dropped in any run)."), "",
            *table(results), "", *differences(results), "",
            ("The end rule counts decode steps, so the same responses end each rollout under either "
             "placement: the off-policy share of `partial` and `adaptive + partial` is equal by "
             "construction, and what adaptive changes is the time each step takes (its plan puts the "
             "carried responses, planned by their remaining length, and the long fresh ones on resident "
             "ranks, shrinks and migrates)."), END]


def write_section(path: Path, lines: list[str]) -> None:
    """Replace the section `lines` opens and closes (its first and last line are its markers; also
    tools/bench_train_elastic.py's), or insert it before the trace parameters."""
    text = path.read_text(encoding="utf-8")
    block, begin, end = "\n".join(lines), lines[0], lines[-1]
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:  # before the trace parameters, after the per-trace tables
        anchor = "## Trace parameters"
        text = text.replace(anchor, block + "\n\n" + anchor, 1) if anchor in text else text + "\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=",".join(PRESETS), help="names, or held-out")
    ap.add_argument("--rollouts", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", type=Path, help="replace this file's partial-rollout section")
    ap.add_argument("--ablation", action="store_true",
                    help="also adaptive + partial with the carried responses' tokens so far hidden from the planner")
    args = ap.parse_args(argv)
    names = [n for n in args.traces.replace("held-out", ",".join(HELD_OUT)).split(",") if n]
    unknown = [n for n in names if n not in TRACES]
    if unknown:
        ap.error(f"unknown trace {unknown[0]!r}; traces are {', '.join(TRACES)} (or held-out)")
    cost, shape, config = CostModel(), ModelShape(), SimConfig()
    results = {n: run_trace(n, args.rollouts, args.seed, cost, shape, config, args.ablation) for n in names}
    lines = section(results, args.rollouts, args.seed)
    print("\n".join(lines[3:-1]))
    if args.write:
        write_section(args.write, lines)
        print(f"wrote the section into {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
