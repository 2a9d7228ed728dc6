"""`flexfloor train`: GRPO post-training on W ranks (spawned here, or joined under torchrun).

`device: cuda` (or --device cuda) runs one rank per GPU (cuda:LOCAL_RANK) over NCCL, e.g. 8 ranks
per node on 8-GPU nodes; `cpu` runs gloo ranks; `auto` picks cuda when CUDA is available.

Any config field can be set after the command: `flexfloor train --config c.yaml grpo.group_size=16
optim.lr=1e-6`; `--print-config` prints the resolved config and exits. Writes DIR/config.yaml (the
resolved config), DIR/metrics.jsonl (one object per step), DIR/wandb/ (offline unless WANDB_MODE=online;
upload later with `wandb sync DIR/wandb/offline-run-*`),
DIR/checkpoints/step_<N>/ and, after the last step, DIR/hf/. Rerunning with the same --out resumes
from the latest checkpoint (--resume-step N: from step N's); `flexfloor export --out DIR [--step N]`
writes any checkpoint as a HuggingFace folder. One run at a time may use an --out folder.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from elastic.planning.policies import POLICIES


def run(args) -> int:
    from megatron_rl.cli.outputs import check_out_dir, check_out_file
    from megatron_rl.cli.overrides import resolve
    from megatron_rl.config import config_yaml
    from megatron_rl.files.out_lock import LOCK_NAME, hold_out_dir
    from megatron_rl.files.owned_paths import removed_if_refused
    from megatron_rl.preflight import preflight
    from megatron_rl.train_driver import run_training
    from megatron_rl.trainer_config import TrainerConfig

    flags = (("policy", "elastic.policy"), ("floor", "elastic.floor"), ("steps", "steps"),
             ("ranks", "ranks"), ("seed", "seed"), ("device", "device"),
             ("allow_unverified_checkpoint", "checkpoint.allow_unverified"), ("deadline", "end_by"))
    cfg = resolve(TrainerConfig, args.config, args, flags, world_size_key="ranks")
    cfg.logging.experiment = cfg.logging.experiment or Path(args.config).stem  # the W&B group
    if args.print_config:
        print(config_yaml(cfg), end="")
        return 0
    # What this machine cannot run is refused before any output.
    preflight(cfg.backend, cfg.dtype, cfg.leases, cfg.optim.offload)
    with removed_if_refused(args.out, "checkpoints", LOCK_NAME):  # a refused run leaves nothing it made
        check_out_dir(args.out, "--out")
        check_out_dir(Path(args.out) / "checkpoints", "--out")  # read-only: found now, not at the first save
        check_out_file(args.json, "--json")
        with hold_out_dir(args.out, "train"):
            summary = run_training(cfg, args.out, preflight_done=True, resume_step=args.resume_step)
    if summary is None:  # a non-zero rank under torchrun
        return 0
    curve = summary["reward_curve"]
    if curve:
        print(f"reward_mean: step {summary['start_step'] + 1} {curve[0]:.3f} -> step "
              f"{summary['start_step'] + len(curve)} {curve[-1]:.3f}; {summary['wall_s']:.1f}s")
    if summary.get("val_pass@1"):
        val = summary["val_pass@1"]
        print(f"held-out pass@1: step {val[0][0]} {val[0][1]:.3f} -> step {val[-1][0]} {val[-1][1]:.3f}")
    print(f"metrics: {os.path.join(args.out, 'metrics.jsonl')}")
    if "stopped" in summary:
        st = summary["stopped"]
        where = f"warm-start step {st['sft_step']}" if "sft_step" in st else f"step {st['step']}"
        why = f"by {st['signal']}" if "signal" in st else f"before the deadline ({st['deadline']})"
        print(f"stopped {why} after {where} (checkpoint saved); the same command resumes from it", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="GRPO post-training of the MoE model (rollout -> reward -> update)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML trainer config, e.g. examples/tiny_cpu_grpo.yaml")
    p.add_argument("--out", default="runs/train", help="output folder (resumes if it holds a checkpoint)")
    p.add_argument("--policy", choices=POLICIES,
                   help="rollout policy (elastic.policy)")
    p.add_argument("--floor", type=int, help="fewest ranks the EP group may shrink to (elastic.floor)")
    p.add_argument("--steps", type=int, help="train until this step")
    p.add_argument("--ranks", type=int, help="number of ranks (ignored under torchrun)")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="cpu: gloo ranks; cuda: one GPU per rank over NCCL; auto: cuda when available")
    p.add_argument("--resume-step", type=int, metavar="N",
                   help="resume from checkpoint step N of --out instead of the latest (the later "
                        "checkpoints and metrics are replaced as the run passes them again)")
    p.add_argument("--allow-unverified-checkpoint", action="store_true", default=None,
                   help="resume from a checkpoint that has no checksums.json (only one you trust: "
                        "see docs/training.md)")
    p.add_argument("--deadline", metavar="TIME",
                   help="save and stop before TIME (ISO 8601 or Unix seconds; end_by): a step starts only "
                        "if it and its save fit, from the slowest measured (default under Slurm: the "
                        "job's end less FF_SIGNAL_LEAD_S)")
    p.add_argument("--json", metavar="OUT", help="write the run summary (reward curve, wall time) here")
    from megatron_rl.cli.overrides import add_override_args

    add_override_args(p)
    p.set_defaults(func=run)
