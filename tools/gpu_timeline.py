"""The stages of tools/gpu_check.sh per profile, their H200 times, and the projected timeline.

A lent H200 gives about 15 minutes in all, so a profile must fit its budget (`FF_GPU_BUDGET_S`,
285 s: a run and a rerun) before it starts. Each stage's time is the last one measured on an H200
where there is one, else an estimate (a trace of stand-ins sleeping each stage's estimated time; no stage below has
run on a GPU since the stages were split). After a GPU
run, copy the `seconds` of its stage rows here and mark them measured.

    python tools/gpu_timeline.py default [--budget 285]     # the projected timeline; exit 1 without 20% margin
    python tools/gpu_timeline.py --rows "tests/gpu (a, b)"   # the rows a stage reports
    python tools/gpu_timeline.py --visit [--budget 285]       # start + profile + rerun, within 900 s
"""
from __future__ import annotations

import argparse
import sys

# stage -> (seconds on one H200, "measured YYYY-MM-DD" or "estimate", the summary rows it reports)
STAGES = {
    "te: image guard": (2, "estimate", ("te: image guard",)),
    "w: carried wheels": (8, "estimate", ("w: carried wheels",)),
    "tests/gpu (c engine, b bf16)": (87, "estimate", (
        "c: capture safety", "c: decode step, sync debug mode error", "c: graph replay = eager tokens (bf16)",
        "b: bf16 responses per policy vs vanilla", "k: paged vs slot KV, decode batch 64")),
    "tests/gpu (a, b)": (70, "estimate", ("a: greedy bf16 vs fp64 CPU", "a: 5 GRPO steps bf16",
                                          "b: 2-rank elastic, one GPU")),
    "c: bench small model": (55, "estimate", ("c: decode tokens/s, batch 1", "c: decode tokens/s, batch 64",
                                              "c: graphed tokens = eager tokens")),
    "s: sglang lease": (1, "estimate: not on the bare image, a skip row", ("s: sglang lease",)),
    "m: logits vs torch backend": (40, "estimate", ("m: logits vs torch backend",)),
    "m: greedy generation": (30, "estimate", ("m: greedy generation",)),
    "m: 5 GRPO steps bf16": (40, "estimate", ("m: 5 GRPO steps bf16",)),
    "m: train backend=megatron, checkpoint + resume": (35, "estimate",
                                                       ("m: train backend=megatron, checkpoint + resume",)),
    "m: decode tokens/s": (20, "estimate", ("m: decode tokens/s, GroupedMM", "m: decode tokens/s, SequentialMLP")),
    "tests/gpu (training)": (50, "estimate", ("a: bf16 GRPO per-update table", "o: offloaded optimizer step")),
    "c: bench 30B slice + step table": (60, "estimate", ("c: 30B-A3B slice step vs roofline, batch 64",
                                                         "c: slice step-time table")),
}
# Priority order within each profile: what the budget cuts comes last.
PROFILES = {
    "default": ["te: image guard", "w: carried wheels", "tests/gpu (c engine, b bf16)", "tests/gpu (a, b)",
                "c: bench small model", "s: sglang lease"],
    "megatron-train": ["w: carried wheels", "m: logits vs torch backend", "m: greedy generation",
                       "m: 5 GRPO steps bf16", "m: train backend=megatron, checkpoint + resume", "m: decode tokens/s",
                       "tests/gpu (training)"],
    # Apart, so each profile keeps its 20% margin: megatron-train with it would project 283 s of 285.
    "slice": ["w: carried wheels", "c: bench 30B slice + step table"],
}
MARGIN = 0.2  # the share of the budget a profile leaves free: estimates err, a stage's start costs
# Rows of figures against targets (tools/gpu_summary.py lists them after the correctness rows, with
# a verdict of their own: a run that fails only these exits 3, not 1).
SPEED_ROWS = frozenset({
    "c: decode tokens/s, batch 1", "c: decode tokens/s, batch 64", "c: 30B-A3B slice step vs roofline, batch 64",
    "c: slice step-time table", "m: decode tokens/s, GroupedMM", "m: decode tokens/s, SequentialMLP",
    "m: decode tokens/s, TEGroupedMLP", "o: offloaded optimizer step"})
# A lent GPU: 15 minutes of device time, a start of up to 4 minutes (docs/gpu.md, "A 15-minute visit").
VISIT_S, START_S = 900, 240


def timeline(profile: str, budget_s: float) -> tuple[str, bool]:
    """(the table, whether the profile fits the budget with the margin)."""
    lines = [f"projected H200 timeline, profile {profile}, budget {budget_s:.0f} s:"]
    t = 0.0
    for name in PROFILES[profile]:
        s, source, _rows = STAGES[name]
        t += s
        over = "  (over the budget: cut, a skip row)" if t > budget_s else ""
        lines.append(f"  {t - s:>5.0f} -> {t:>5.0f} s  {name}  ({s} s, {source}){over}")
    fits = t <= (1 - MARGIN) * budget_s
    lines.append(f"  total {t:.0f} s of {budget_s:.0f} s: {1 - t / budget_s:.0%} margin "
                 f"({'fits' if fits else 'does NOT fit'} with the {MARGIN:.0%} a profile keeps free)")
    return "\n".join(lines), fits


def worst_case(budget_s: float) -> tuple[str, bool]:
    """(the visit's worst case, whether it fits): a slow start, the profile cut at its budget, and
    a rerun of the failed stages cut at the same budget."""
    total = START_S + 2 * budget_s
    return (f"worst case of a {VISIT_S}-s GPU visit: start {START_S} s + profile {budget_s:.0f} s (its cap) + rerun "
            f"of failed stages {budget_s:.0f} s (FF_GPU_STAGES, the same cap) = {total:.0f} s, "
            + (f"{VISIT_S - total:.0f} s to spare" if total <= VISIT_S else f"OVER by {total - VISIT_S:.0f} s")), \
        total <= VISIT_S


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", nargs="?", choices=sorted(PROFILES))
    p.add_argument("--budget", type=float, default=285.0)
    p.add_argument("--rows", metavar="STAGE", help="print the rows STAGE reports, one a line")
    p.add_argument("--visit", action="store_true", help="print the visit's worst case; exit 1 if over 900 s")
    args = p.parse_args(argv)
    if args.rows:
        print("\n".join(STAGES[args.rows][2]))
        return 0
    if args.visit:
        line, fits = worst_case(args.budget)
        print(line)
        return 0 if fits else 1
    table, fits = timeline(args.profile, args.budget)
    print(table)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
