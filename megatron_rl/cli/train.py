"""`flexfloor train`: GRPO post-training on W CPU ranks (spawned here, or joined under torchrun).

Writes DIR/metrics.jsonl (one object per step), DIR/wandb/ (offline unless WANDB_MODE=online),
DIR/checkpoints/step_<N>/ and, after the last step, DIR/hf/. Rerunning with the same --out resumes
from the latest checkpoint.
"""
from __future__ import annotations

import json
import os


def run(args) -> int:
    from megatron_rl.config import load_dataclass
    from megatron_rl.parallel.launch import under_torchrun
    from megatron_rl.trainer import run_training
    from megatron_rl.trainer_config import TrainerConfig

    overrides = {}
    for flag, key in (("policy", "elastic.policy"), ("floor", "elastic.floor"), ("steps", "steps"),
                      ("ranks", "ranks"), ("seed", "seed")):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    if under_torchrun():
        overrides["ranks"] = int(os.environ["WORLD_SIZE"])
    cfg = load_dataclass(TrainerConfig, args.config, overrides)
    summary = run_training(cfg, args.out)
    if summary is None:  # a non-zero rank under torchrun
        return 0
    curve = summary["reward_curve"]
    if curve:
        print(f"reward_mean: step {summary['start_step'] + 1} {curve[0]:.3f} -> step "
              f"{summary['steps']} {curve[-1]:.3f}; {summary['wall_s']:.1f}s")
    print(f"metrics: {os.path.join(args.out, 'metrics.jsonl')}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="GRPO post-training of the MoE model (rollout -> reward -> update)",
                       description=__doc__)
    p.add_argument("--config", required=True, help="YAML trainer config, e.g. examples/tiny_cpu_grpo.yaml")
    p.add_argument("--out", default="runs/train", help="output folder (resumes if it holds a checkpoint)")
    p.add_argument("--policy", choices=["vanilla", "lengthsort", "natural", "planned", "adaptive"],
                   help="rollout policy (elastic.policy)")
    p.add_argument("--floor", type=int, help="fewest ranks the EP group may shrink to (elastic.floor)")
    p.add_argument("--steps", type=int, help="train until this step")
    p.add_argument("--ranks", type=int, help="number of ranks (ignored under torchrun)")
    p.add_argument("--seed", type=int)
    p.add_argument("--json", metavar="OUT", help="write the run summary (reward curve, wall time) here")
    p.set_defaults(func=run)
