"""`flexfloor train` with and without reward-scoring leases, side by side: the reward phase's time.

    python tools/bench_train_leases.py [--steps 6] [--reward math] [--reps 1] [--json OUT]

Both runs start from the same warm start (`examples/tiny_cpu_grpo.yaml`'s 250 SFT steps, made once
here), train `--steps` GRPO steps with `--policy natural --floor 1` and the given reward kind, and
differ only in `leases.jobs` ([rewards] vs []). Runs alternate (on, off, on, off, ...) so machine
drift hits both. Printed per step: `timing_s/reward` of each, the rewards scored in leases and the
leased rank-seconds; the training figures must be identical (checked, exit 1 otherwise).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny_cpu_grpo.yaml"
# metrics.jsonl's names (megatron_rl/metrics/keys.py): the training figures both runs must share;
# reward/outcomes is a dict, logged as one key per outcome under that prefix.
SAME = ("reward/mean", "reward/outcomes/", "actor/loss", "actor/grad_norm", "elastic/placement")


def training_figures(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.startswith(SAME)}


def _run(*args) -> None:
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   env={**__import__("os").environ, "WANDB_MODE": "disabled"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reward", choices=["exact", "math"], default="math")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--json", help="write every run's metrics here")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_leases."))
    print(f"bench_train_leases: warm start, then {2 * args.reps} runs of {args.steps} steps in {tmp}...",
          file=sys.stderr, flush=True)
    _run("tools/sft_warmstart.py", "--config", str(EXAMPLE), "--out", str(tmp / "sft"))
    runs: dict[str, list[list[dict]]] = {"leases": [], "no leases": []}
    for rep in range(args.reps):
        for name, jobs in (("leases", ["rewards"]), ("no leases", [])):
            cfg = yaml.safe_load(EXAMPLE.read_text())
            cfg.update(init=str(tmp / "sft"), steps=args.steps)
            cfg["warmstart"]["sft_steps"] = 0
            cfg["checkpoint"] = {"every": 0, "export_hf": False}
            cfg["reward"]["kind"] = args.reward
            cfg["leases"]["jobs"] = jobs
            path, out = tmp / f"{name[:2]}{rep}.yaml", tmp / f"{name[:2]}{rep}"
            path.write_text(yaml.safe_dump(cfg))
            _run("-m", "megatron_rl.cli", "train", "--config", str(path), "--out", str(out),
                 "--policy", "natural", "--floor", "1")
            rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            # The training steps' rows (step 0's holds the warm start's validation only).
            runs[name].append([m for m in rows if "timing_s/step" in m])
    on, off = runs["leases"], runs["no leases"]
    same = all([training_figures(m) for m in a] == [training_figures(m) for m in b]
               for a in on + off for b in on[:1])

    def med(rs, step, f):
        return statistics.median(f(r[step]) for r in rs)

    print(f"reward.kind {args.reward}; medians over {args.reps} rep(s)")
    print(f"{'step':>4}{'reward s (leases)':>19}{'reward s (none)':>17}{'ratio':>7}{'scored in leases':>18}"
          f"{'leased rank-s':>15}")
    for i in range(args.steps):
        a = med(on, i, lambda m: m["timing_s/reward"])
        b = med(off, i, lambda m: m["timing_s/reward"])
        print(f"{i + 1:>4}{a:>19.4f}{b:>17.4f}{a / b:>7.2f}{med(on, i, lambda m: m['lease/rewards_scored']):>18.0f}"
              f"{med(on, i, lambda m: m['lease/leased_rank_s']):>15.4f}")
    ta = statistics.median(sum(m["timing_s/reward"] for m in r) for r in on)
    tb = statistics.median(sum(m["timing_s/reward"] for m in r) for r in off)
    print(f"all steps: reward phase {ta:.4f} s with leases vs {tb:.4f} s without ({ta / tb:.2f}x); "
          f"rewards, losses and placements identical: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
