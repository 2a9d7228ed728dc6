"""The validation curve of a `flexfloor train` run: held-out greedy pass@1 (`val/pass@1`, every
`eval.every` steps and at step 0, the warm start) beside the training reward (`reward/mean`, sampled
responses of the training prompts), from the run's metrics.jsonl.

    python tools/plot_validation.py runs/tiny/metrics.jsonl --out docs/figures/tiny_validation.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def curves(metrics: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """((step, val/pass@1), (step, reward/mean)) of a metrics.jsonl."""
    val, reward = [], []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "val/pass@1" in row:
            val.append((row["step"], row["val/pass@1"]))
        if "reward/mean" in row:
            reward.append((row["step"], row["reward/mean"]))
    return val, reward


def plot(metrics: Path, out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    val, reward = curves(metrics)
    if not val:
        raise SystemExit(f"plot_validation: error: {metrics} has no val/pass@1 (set eval.path and eval.every)")
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    ax.plot(*zip(*reward), color="0.7", lw=1, label="training reward (sampled, reward/mean)")
    ax.plot(*zip(*val), "o-", color="C0", lw=2, label="held-out greedy pass@1 (val/pass@1)")
    ax.axhline(val[0][1], color="C0", ls=":", lw=1, label=f"warm start (step 0): {val[0][1]:.3f}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("share correct")
    ax.set_ylim(0, 1)
    ax.set_title(title or metrics.parent.name)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    plot(args.metrics, args.out, args.title)
    val, _ = curves(args.metrics)
    print("held-out pass@1: " + ", ".join(f"step {s} {v:.3f}" for s, v in val))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
