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

from elastic.planning.policies import POLICIES
from megatron_rl.cli.overrides import add_override_args


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
    add_override_args(p)
