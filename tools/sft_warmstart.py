"""SFT warm start on its own: train `warmstart.sft_steps` supervised steps, write a HF checkpoint.

    python tools/sft_warmstart.py --config examples/tiny_cpu_grpo.yaml --out runs/sft [--steps 250]

Point the trainer's `init:` at the output (and set `warmstart.sft_steps: 0`) to start RL from it;
`flexfloor train` also runs the same warm start itself when `warmstart.sft_steps > 0`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elastic.errors import InputError
from megatron_rl.backends import backend
from megatron_rl.config import load_dataclass
from megatron_rl.rl.sft import run_warmstart
from megatron_rl.trainer_config import TrainerConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True, help="folder for the HuggingFace checkpoint")
    p.add_argument("--steps", type=int, help="override warmstart.sft_steps")
    p.add_argument("--ranks", type=int)
    args = p.parse_args()
    overrides = {k: v for k, v in (("warmstart.sft_steps", args.steps), ("ranks", args.ranks)) if v is not None}
    try:
        cfg = load_dataclass(TrainerConfig, args.config, overrides)
        losses = run_warmstart(cfg, backend(cfg.backend), args.out)
    except InputError as e:
        print(f"sft_warmstart: error: {e}", file=sys.stderr)
        return 2
    if losses:
        print(f"SFT loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
