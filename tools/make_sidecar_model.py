"""Make the sidecar's model: an arithmetic Qwen3-MoE trained here by SFT, with held-out queries.

    python tools/make_sidecar_model.py --out runs/sidecar_arith [--steps 3000] [--heldout 100]

Writes OUT/train.jsonl and OUT/heldout.jsonl (a split of every `a+b=` / `a-b=` problem with operands
0..20, seeded), trains `examples/tiny_cpu_grpo.yaml`'s model on the train split with teacher-forced
SFT (`tools/sft_warmstart.py`'s code, one rank), writes the HuggingFace checkpoint to OUT/model, and
serves the held-out queries once through the sidecar's own code to measure greedy accuracy
(OUT/eval.json). No downloads. Point `sidecar.checkpoint` at OUT/model and `sidecar.queries` at
OUT/heldout.jsonl.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elastic.errors import InputError
from megatron_rl.backends import backend
from megatron_rl.config import load_dataclass
from megatron_rl.data.arith import make_problems, write_jsonl
from megatron_rl.rl.sft import run_warmstart
from megatron_rl.rollout.leases.sidecar import SidecarConfig, SidecarJob
from megatron_rl.trainer_config import TrainerConfig

MAX_OPERAND, OPS = 20, "+-"


def evaluate(model_dir: Path, queries: Path, max_new_tokens: int = 4) -> dict:
    """Greedy accuracy on `queries`: one full pass of the sidecar job, never pre-empted."""
    job = SidecarJob(SidecarConfig(str(model_dir), str(queries), max_new_tokens=max_new_tokens, batch=64),
                     repeat=False)
    job.run(lambda: False)
    return job.report()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", default="examples/tiny_cpu_grpo.yaml", help="model shape and SFT settings")
    p.add_argument("--steps", type=int, default=3000, help="SFT steps")
    p.add_argument("--heldout", type=int, default=100, help="problems kept out of training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    out = Path(args.out)
    problems = make_problems((MAX_OPERAND + 1) ** 2 * len(OPS), args.seed, MAX_OPERAND, OPS)
    held, train = problems[: args.heldout], problems[args.heldout:]
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(held, out / "heldout.jsonl")
    overrides = {"data.path": str(out / "train.jsonl"), "warmstart.sft_steps": args.steps,
                 "warmstart.lr": args.lr, "ranks": 1, "seed": args.seed, "dtype": "float32"}
    t0 = time.perf_counter()
    try:
        cfg = load_dataclass(TrainerConfig, args.config, overrides)
        losses = run_warmstart(cfg, backend(cfg.backend), str(out / "model"))
    except InputError as e:
        print(f"make_sidecar_model: error: {e}", file=sys.stderr)
        return 2
    report = evaluate(out / "model", out / "heldout.jsonl")
    report.update(sft_steps=args.steps, sft_loss=[losses[0], losses[-1]], train=len(train),
                  heldout=len(held), wall_s=round(time.perf_counter() - t0, 1))
    (out / "eval.json").write_text(json.dumps(report, indent=1))
    print(f"SFT loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps; held-out greedy "
          f"accuracy {report['accuracy']:.1%} ({report['correct']}/{report['distinct']}); wrote {out}/model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
