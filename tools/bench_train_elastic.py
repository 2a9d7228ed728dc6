"""`flexfloor train` under every elastic policy, side by side, on the length-tailed counting task.

    python tools/bench_train_elastic.py [--steps 24] [--init DIR] [--write docs/reproduction.md]

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
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
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


def train(tmp: Path, label: str, policy: str, partial: bool, init: Path, steps: int) -> list[dict]:
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg.update(init=str(init), steps=steps)
    cfg["warmstart"]["sft_steps"] = 0
    cfg["checkpoint"] = {"every": 0, "export_hf": True}
    cfg["partial"] = {"enabled": partial}
    for key in ("data", "eval"):
        cfg[key]["path"] = str(ROOT / cfg[key]["path"])
    name = label.replace(" + ", "_")
    path, out = tmp / f"{name}.yaml", tmp / name
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    _run("-m", "megatron_rl.cli", "train", "--config", str(path), "--out", str(out), "--policy", policy,
         log=tmp / f"{name}.log")
    print(f"  {label}: {steps} steps in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def learning(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k.startswith(LEARNING)} for m in rows]


def same_weights(tmp: Path, a: str, b: str) -> bool:
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
    out["gen_s"] = sum(m["timing_s/gen"] for m in steps) / n
    out["step_s"] = sum(m["timing_s/step"] for m in steps) / n
    out["tokens"] = sum(m["perf/response_tokens"] for m in steps) / n
    out["tok_per_occ"] = out["tokens"] / out["occupied"]
    out["tok_per_occ_step"] = out["tokens"] / out["occupied_steps"]
    out["steps"] = n
    return out


def table(fig: dict[str, dict]) -> list[str]:
    van = fig["vanilla"]
    out = ["| policy | busy | dummy | transition | leased | idle | rollout rank-s | rollout s | gen s | step s "
           "| tok/occupied rank-s | dummy cut | rollout rank-s cut | tok/occ vs vanilla |",
           "|---|" + "---|" * 13]
    for label, f in fig.items():
        out.append(f"| {label} | " + " | ".join(f"{f[s]:.2f}" for s in STATES)
                   + f" | {f['occupied']:.2f} | {f['rollout_s']:.2f} | {f['gen_s']:.2f} | {f['step_s']:.2f} "
                   f"| {f['tok_per_occ']:.1f} | {1 - f['dummy'] / van['dummy']:.1%} "
                   f"| {1 - f['occupied'] / van['occupied']:.1%} | {f['tok_per_occ'] / van['tok_per_occ']:.2f}x |")
    return out


def step_table(fig: dict[str, dict]) -> list[str]:
    """The same in rank-steps (decode ticks): what the rollout did, whatever the cores' contention."""
    van = fig["vanilla"]
    out = ["| policy | busy | dummy | transition | leased | idle | rollout rank-steps | tok/occupied rank-step "
           "| dummy cut | rollout rank-steps cut | tok/occ vs vanilla |", "|---|" + "---|" * 10]
    for label, f in fig.items():
        out.append(f"| {label} | " + " | ".join(f"{f[s + '_steps']:.0f}" for s in STATES)
                   + f" | {f['occupied_steps']:.0f} | {f['tok_per_occ_step']:.2f} "
                   f"| {1 - f['dummy_steps'] / van['dummy_steps']:.1%} "
                   f"| {1 - f['occupied_steps'] / van['occupied_steps']:.1%} "
                   f"| {f['tok_per_occ_step'] / van['tok_per_occ_step']:.2f}x |")
    return out


def curves(runs: dict[str, list[dict]]) -> list[str]:
    """Held-out greedy reward (and the training reward) at each evaluated step, per policy."""
    labels = [lb for lb in runs if lb not in SAME_TRAINING[1:]]
    heads = ["vanilla = planned = adaptive" if lb == "vanilla" else lb for lb in labels]
    out = ["| step | " + " | ".join(f"held-out reward ({h})" for h in heads) + " |", "|---|" + "---|" * len(labels)]
    evals = sorted({m["step"] for m in runs["vanilla"] if "val/reward_mean" in m})
    for step in evals:
        vals = [next((m["val/reward_mean"] for m in runs[lb] if m["step"] == step and "val/reward_mean" in m), None)
                for lb in labels]
        out.append(f"| {step} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in vals) + " |")
    return out


def section(fig, runs, steps: int, first: int, identical: bool, machine: str) -> list[str]:
    return [BEGIN, "## Training on a length-tailed task: every policy", "",
            (f"Generated by `python tools/bench_train_elastic.py --steps {steps} --write docs/reproduction.md` "
             f"on {machine}: `examples/tiny_cpu_tailed.yaml` (count from a to b; responses of 4 to 192 tokens), "
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
            *step_table(fig), "", "Held-out greedy reward (`val/reward_mean`, 32 problems the training set lacks):",
            "", *curves(runs), "", END]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--init", type=Path, help="a warm start to reuse (tools/sft_warmstart.py's output)")
    ap.add_argument("--policies", default=",".join(lb for lb, _, _ in POLICIES),
                    help="comma-separated labels (vanilla is always run)")
    ap.add_argument("--write", type=Path, help="replace this file's section (docs/reproduction.md)")
    ap.add_argument("--json", type=Path, help="write every run's metrics here")
    ap.add_argument("--machine", default="a 2-core machine shared with other work")
    args = ap.parse_args(argv)
    chosen = {"vanilla", *args.policies.split(",")}
    unknown = chosen - {lb for lb, _, _ in POLICIES}
    if unknown:
        ap.error(f"unknown policy {sorted(unknown)[0]!r}; policies are {', '.join(lb for lb, _, _ in POLICIES)}")
    cfg = yaml.safe_load(EXAMPLE.read_text())
    epoch = -(-sum(1 for line in (ROOT / cfg["data"]["path"]).open() if line.strip()) // cfg["prompts_per_step"])
    if args.steps <= epoch:
        ap.error(f"--steps {args.steps}: the figures are over the steps after the first epoch ({epoch} steps)")
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_elastic."))
    init = args.init
    if init is None:
        print(f"bench_train_elastic: warm start in {tmp}/sft ...", file=sys.stderr, flush=True)
        init = tmp / "sft"
        _run("tools/sft_warmstart.py", "--config", str(EXAMPLE), "--out", str(init), log=tmp / "sft.log")
    print(f"bench_train_elastic: {len(chosen)} runs of {args.steps} steps in {tmp}", file=sys.stderr, flush=True)
    runs = {lb: train(tmp, lb, pol, part, init.resolve(), args.steps) for lb, pol, part in POLICIES if lb in chosen}
    same = [lb for lb in SAME_TRAINING if lb in runs]
    identical = all(learning(runs[lb]) == learning(runs["vanilla"]) and same_weights(tmp, "vanilla", lb)
                    for lb in same)
    fig = {lb: figures(rows, epoch + 1) for lb, rows in runs.items()}
    lines = section(fig, runs, args.steps, epoch + 1, identical, args.machine)
    print("\n".join(lines[3:-1]))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    if args.write:
        write_section(args.write, lines)
        print(f"wrote the section into {args.write}", file=sys.stderr)
    if not identical:
        print(f"bench_train_elastic: {', '.join(same)} did not train identically", file=sys.stderr)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
