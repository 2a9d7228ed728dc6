"""`flexfloor train` (its flags: megatron_rl/cli/train.py): the resolved config, the machine's
preflight and the output folder checked, then the run (`train_driver.py`) and its summary."""
from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.commands.outputs import check_out_dir, check_out_file
from megatron_rl.commands.resolve import resolve
from megatron_rl.config import config_yaml
from megatron_rl.files.out_lock import LOCK_NAME, hold_out_dir
from megatron_rl.files.owned_paths import removed_if_refused
from megatron_rl.preflight import preflight
from megatron_rl.train_driver import run_training
from megatron_rl.trainer_config import TrainerConfig


def run(args) -> int:
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
