"""`flexfloor train` under every elastic policy, side by side, on the length-tailed counting task.

    python tools/bench_train_elastic.py [--steps 24] [--init DIR] [--write docs/reproduction.md]
    python tools/bench_train_elastic.py --config examples/tiny_cpu_grpo.yaml --policies adaptive \
        --steps 12 --from-step 1 --repeats 3    # where there is no tail: what adaptive costs

Every run starts from one warm start (`examples/tiny_cpu_tailed.yaml`'s SFT steps, made once here, or
`--init`), trains `--steps` GRPO steps on 4 CPU ranks in float64 with the same seeds, and differs
only in the rollout: `vanilla` (nobody leaves), `planned` (predicted-long prompts on resident ranks,
the group shrinking to the floor), `adaptive` (planned, then re-planned and migrated online),
`partial` (vanilla with partial rollouts) and `adaptive + partial`. Vanilla, planned and adaptive
must train bit-identically (every learning metric and the final weights; exit 1 otherwise), so
their reward curve is one curve and only time differs; partial trains other tokens by design.

Printed per policy, over the steps after the first epoch (the history predictor's first chance):
rollout rank-seconds per step by ledger state, rollout and step wall time, tokens per occupied
rank-second, and the ratios against vanilla; then the held-out reward curve. Rank-seconds from the
ledger are the primary figure: the ranks are processes sharing this machine's cores, so a detached
rank speeds the others up and wall-clock gains overstate what separate devices would see.
`--repeats N` runs every policy N times, interleaved (vanilla, adaptive, vanilla, adaptive, ...),
and pools their steps, so that on a machine whose load changes every policy's figures span the
same stretch of time; it also prints each policy's median rollout time against vanilla's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_partial import write_section

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny_cpu_tailed.yaml"
STATES = ("busy", "dummy", "transition", "leased", "idle")
OCCUPIED = ("busy", "dummy", "transition")
# (label, --policy, partial rollouts on)
POLICIES = [("vanilla", "vanilla", False), ("planned", "planned", False), ("adaptive", "adaptive", False),
            ("partial", "vanilla", True), ("adaptive + partial", "adaptive", True)]
SAME_TRAINING = ("vanilla", "planned", "adaptive")
# What training sees (timings, the ledger, placements and stages are the rollout's own).
LEARNING = ("reward/", "response_length/", "actor/", "training/", "val/")
BEGIN, END = "<!-- bench_train_elastic:begin -->", "<!-- bench_train_elastic:end -->"


def _run(*args, log: Path | None = None) -> None:
    with open(log or os.devnull, "w") as fh:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                              env={**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        raise SystemExit(f"bench_train_elastic: {' '.join(args[:3])} failed (exit {proc.returncode}); see {log}")


@dataclass(frozen=True)
class Run:
    """One training run of the bench: a policy's label, its --policy, partial rollouts on, and which
    of the interleaved repeats it is."""

    label: str
    policy: str
    partial: bool
    repeat: int = 0

    @property
    def name(self) -> str:  # its folder under the bench's tmp
        return self.label.replace(" + ", "_") + (f".{self.repeat}" if self.repeat else "")


def train(tmp: Path, config: Path, run: Run, init: Path | None, steps: int, eval_every: int | None) -> list[dict]:
    cfg = yaml.safe_load(config.read_text())
    cfg.update(init=None if init is None else str(init), steps=steps)
    if eval_every is not None and cfg.get("eval"):
        cfg["eval"]["every"] = eval_every
    cfg["warmstart"]["sft_steps"] = 0
    cfg["checkpoint"] = {"every": 0, "export_hf": True}
    cfg["partial"] = {"enabled": run.partial}
    for key in ("data", "eval"):
        if cfg.get(key, {}).get("path"):
            cfg[key]["path"] = str(ROOT / cfg[key]["path"])
    path, out = tmp / f"{run.name}.yaml", tmp / run.name
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    _run("-m", "megatron_rl.cli", "train", "--config", str(path), "--out", str(out), "--policy", run.policy,
         log=tmp / f"{run.name}.log")
    print(f"  {run.name}: {steps} steps in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return [{**json.loads(x), "repeat": run.repeat} for x in (out / "metrics.jsonl").read_text().splitlines()]


def learning(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k.startswith(LEARNING)} for m in rows]


def same_weights(tmp: Path, a: str, b: str) -> bool:
    """Whether the runs in folders `a` and `b` exported the same weights."""
    from safetensors.torch import load_file

    wa, wb = (load_file(str(tmp / n / "hf" / "model.safetensors")) for n in (a, b))
    return wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)


def figures(rows: list[dict], first: int) -> dict:
    """Per-step means over the steps from `first` on (rank-seconds, walls) and the tokens per
    occupied rank-second of those steps together."""
    steps = [m for m in rows if m.get("step", 0) >= first and "elastic/rollout_time_s" in m]
    n = len(steps)
    out = {s: sum(m[f"elastic/rank_seconds/{s}"] for m in steps) / n for s in STATES}
    out["occupied"] = sum(out[s] for s in OCCUPIED)
    for s in STATES:
        out[f"{s}_steps"] = sum(m[f"elastic/rank_steps/{s}"] for m in steps) / n
    out["occupied_steps"] = sum(out[f"{s}_steps"] for s in OCCUPIED)
    out["rollout_s"] = sum(m["elastic/rollout_time_s"] for m in steps) / n
    out["rollout_s_median"] = statistics.median(m["elastic/rollout_time_s"] for m in steps)
    out["gen_s_median"] = statistics.median(m["timing_s/gen"] for m in steps)
    out["gen_s"] = sum(m["timing_s/gen"] for m in steps) / n
    out["step_s"] = sum(m["timing_s/step"] for m in steps) / n
    out["tokens"] = sum(m["perf/response_tokens"] for m in steps) / n
    out["tok_per_occ"] = out["tokens"] / out["occupied"]
    out["tok_per_occ_steps"] = out["tokens"] / out["occupied_steps"]
    out["steps"] = n
    return out


def _cut(x: float, base: float) -> str:
    return f"{1 - x / base:.1%}" if base else "-"


# A table's unit: (suffix of its figures' keys, its name, the rate's denominator, number and rate
# formats). Rank-steps (decode ticks) count what the rollout did, whatever the cores' contention.
SECONDS = ("", "rank-s", "rank-s", ".2f", ".1f")
STEPS = ("_steps", "rank-steps", "rank-step", ".0f", ".2f")


def table(fig: dict[str, dict], unit: tuple = SECONDS) -> list[str]:
    """Per policy: the rollout's ranks by ledger state, tokens per occupied rank and the cuts against
    vanilla, in `unit`; in rank-seconds with the rollout, generation and step walls too."""
    key, name, per, num, rate = unit
    walls = ["rollout s (median)", "gen s (median)", "step s"] if unit == SECONDS else []
    head = ["policy", *STATES, f"rollout {name}", *walls, f"tok/occupied {per}", "dummy cut", f"rollout {name} cut",
            "tok/occ vs vanilla"]
    van = fig["vanilla"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---|" * (len(head) - 1)]
    for label, f in fig.items():
        cells = [label, *(f"{f[s + key]:{num}}" for s in (*STATES, "occupied"))]
        if walls:
            cells += [f"{f['rollout_s']:.3f} ({f['rollout_s_median']:.3f})",
                      f"{f['gen_s']:.3f} ({f['gen_s_median']:.3f})", f"{f['step_s']:.2f}"]
        cells += [f"{f['tok_per_occ' + key]:{rate}}", _cut(f["dummy" + key], van["dummy" + key]),
                  _cut(f["occupied" + key], van["occupied" + key]),
                  f"{f['tok_per_occ' + key] / van['tok_per_occ' + key]:.2f}x"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def verdict(fig: dict[str, dict]) -> list[str]:
    """adaptive against vanilla beside our goals (the paper, arXiv 2611.06984, reports 96%, 24%, +65%)."""
    if "adaptive" not in fig:
        return []
    a, v = fig["adaptive"], fig["vanilla"]
    goals = [("dummy cut", _cut(a["dummy"], v["dummy"]), _cut(a["dummy_steps"], v["dummy_steps"]),
              ">= 80%"),
             ("rollout (busy + dummy + transition) cut", _cut(a["occupied"], v["occupied"]),
              _cut(a["occupied_steps"], v["occupied_steps"]), ">= 20%"),
             ("tokens per occupied rank", f"{a['tok_per_occ'] / v['tok_per_occ']:.2f}x",
              f"{a['tok_per_occ_steps'] / v['tok_per_occ_steps']:.2f}x", ">= 1.5x")]
    return ["| adaptive against vanilla | rank-seconds | rank-steps | goal |", "|---|---|---|---|",
            *(f"| {name} | {sec} | {st} | {goal} |" for name, sec, st, goal in goals)]


def curves(runs: dict[str, list[dict]]) -> list[str]:
    """Held-out greedy reward (and the training reward) at each evaluated step, per policy."""
    labels = [lb for lb in runs if lb not in SAME_TRAINING[1:]]
    heads = [" = ".join(SAME_TRAINING) if lb == SAME_TRAINING[0] else lb for lb in labels]
    out = ["| step | " + " | ".join(f"held-out reward ({h})" for h in heads) + " |", "|---|" + "---|" * len(labels)]
    evals = sorted({m["step"] for m in runs["vanilla"] if "val/reward_mean" in m})
    for step in evals:
        vals = [next((m["val/reward_mean"] for m in runs[lb] if m["step"] == step and "val/reward_mean" in m), None)
                for lb in labels]
        out.append(f"| {step} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in vals) + " |")
    return out


def section(fig, runs, steps: int, first: int, identical: bool, machine: str, command: str,
            config: Path) -> list[str]:
    task = (" (count from a to b; responses of 4 to 192 tokens)" if config.resolve() == EXAMPLE.resolve() else "")
    name = config.resolve().relative_to(ROOT) if config.resolve().is_relative_to(ROOT) else config
    return [BEGIN, "## Training on a length-tailed task: every policy", "",
            (f"Generated by `{command}` on {machine}: `{name}`{task}, "
             f"4 CPU ranks, float64, the same seeds and warm start for every run. Per-step means over steps "
             f"{first}..{steps} (after the first epoch); rank-seconds from the rollout ledger (the primary figure), "
             "`rollout rank-s` = busy + dummy + transition. The ranks are processes sharing the machine's "
             "cores, not pinned to their own: a detached rank speeds the others up, so the wall-clock "
             "columns (`rollout s`, `gen s` with planning, `step s`) overstate what separate devices would "
             "gain. Vanilla, planned and adaptive trained "
             + ("bit-identically (every learning metric and the final weights, checked)" if identical
                else "**not** identically (the check failed)") + "; partial trains other tokens by design."),
            "", *table(fig), "",
            ("The same rollouts in rank-steps (one decode step, shrink or restore of a rank is one step): "
             "a count free of the cores' contention, where a rank-second on a busy core stretches."), "",
            *table(fig, STEPS), "", *verdict(fig), "",
            "Held-out greedy reward (`val/reward_mean`, on the config's held-out problems):", "",
            *curves(runs), "", END]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=EXAMPLE, help="the training config every run starts from")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--from-step", type=int, help="first step the figures count (default: the first after epoch 1)")
    ap.add_argument("--sft-steps", type=int, help="warm start steps (default: the config's; 0: a random init)")
    ap.add_argument("--init", type=Path, help="a warm start to reuse (tools/sft_warmstart.py's output)")
    ap.add_argument("--policies", default=",".join(lb for lb, _, _ in POLICIES),
                    help="comma-separated labels (vanilla is always run)")
    ap.add_argument("--write", type=Path, help="replace this file's section (docs/reproduction.md)")
    ap.add_argument("--json", type=Path, help="write every run's metrics here")
    ap.add_argument("--machine", default="a 2-core machine shared with other work")
    ap.add_argument("--eval-every", type=int, help="held-out evaluation every N steps (default: the config's)")
    ap.add_argument("--parallel", type=int, default=1,
                    help="runs at once (they then share the cores: the wall columns compare runs under one load)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every policy this many times, interleaved, and pool their steps (a loaded machine)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: expected at least 1")
    chosen = {"vanilla", *args.policies.split(",")}
    unknown = chosen - {lb for lb, _, _ in POLICIES}
    if unknown:
        ap.error(f"unknown policy {sorted(unknown)[0]!r}; policies are {', '.join(lb for lb, _, _ in POLICIES)}")
    cfg = yaml.safe_load(args.config.read_text())
    epoch = -(-sum(1 for line in (ROOT / cfg["data"]["path"]).open() if line.strip()) // cfg["prompts_per_step"])
    first = args.from_step or epoch + 1
    if args.steps < first:
        ap.error(f"--steps {args.steps}: the figures count steps {first}.. (after the first epoch: --from-step)")
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_elastic."))
    init = args.init
    if init is None and args.sft_steps != 0:
        print(f"bench_train_elastic: warm start in {tmp}/sft ...", file=sys.stderr, flush=True)
        init = tmp / "sft"
        _run("tools/sft_warmstart.py", "--config", str(args.config), "--out", str(init),
             *(["--steps", str(args.sft_steps)] if args.sft_steps else []), log=tmp / "sft.log")
    plan = [Run(lb, pol, part, k) for k in range(args.repeats) for lb, pol, part in POLICIES if lb in chosen]
    print(f"bench_train_elastic: {len(plan)} runs of {args.steps} steps in {tmp}", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:  # in submission order: the repeats interleave
        started = {run: pool.submit(train, tmp, args.config, run, init and init.resolve(), args.steps,
                                    args.eval_every) for run in plan}
    done, failed = {}, set()
    for run, f in started.items():
        try:
            done[run] = f.result()
        except SystemExit as e:  # a failed run is named; the others are still compared
            print(e, file=sys.stderr)
            failed.add(run.label)
    if "vanilla" in failed:
        return 1
    runs = {lb: [m for run, rows in done.items() if run.label == lb for m in rows]
            for lb, _, _ in POLICIES if lb in chosen and lb not in failed}
    same = [lb for lb in SAME_TRAINING if lb in runs]
    by_name = {(run.label, run.repeat): run for run in done}
    identical = all(learning(done[by_name[lb, k]]) == learning(done[by_name["vanilla", k]])
                    and same_weights(tmp, by_name["vanilla", k].name, by_name[lb, k].name)
                    for lb in same for k in range(args.repeats))
    fig = {lb: figures(rows, first) for lb, rows in runs.items()}
    command = " ".join(["python tools/bench_train_elastic.py", *(sys.argv[1:] if argv is None else argv)])
    machine = args.machine + (f", the {len(runs)} runs at once (one load for all)" if args.parallel > 1 else "")
    lines = section(fig, runs, args.steps, first, identical, machine, command, args.config)
    print("\n".join(lines[3:-1]))
    base = fig["vanilla"]["rollout_s_median"]
    print(f"\nmedian elastic/rollout_time_s of steps {first}..{args.steps} in {args.repeats} interleaved "
          f"repeat(s), against vanilla's {base:.4f} s: "
          + ", ".join(f"{lb} {f['rollout_s_median']:.4f} s ({f['rollout_s_median'] / base:.2f}x)"
                      for lb, f in fig.items() if lb != "vanilla"))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    if args.write:
        write_section(args.write, lines)
        print(f"wrote the section into {args.write}", file=sys.stderr)
    if not identical:
        print(f"bench_train_elastic: {', '.join(same)} did not train identically", file=sys.stderr)
    return 0 if identical and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
