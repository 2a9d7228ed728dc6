"""`flexfloor export`: a training checkpoint of `flexfloor train --out DIR` as a HuggingFace folder.

    flexfloor export --out runs/tiny                 # the latest checkpoint -> runs/tiny/hf
    flexfloor export --out runs/tiny --step 10 --to runs/tiny/hf-step10

`train` exports DIR/hf after its last step by itself; this redoes that (after a failed export, e.g. a
full disk) or exports any earlier checkpoint. One process, no ranks: the model's weights are read
from the checkpoint's shards (verified as a resume verifies them) into a model holding every expert,
which needs the whole model in host memory. The folder is written beside its target and renamed
onto it, so it is the previous export or the whole new one. `--to` replaces only an empty folder, a
previous FlexFloor export (it holds `.flexfloor-export`) or OUT/hf; never OUT itself, a folder
holding it, another folder inside it, a file, `.` or `/` (megatron_rl/files/owned_paths.py). Export
holds OUT's lock: it waits for no `train` and refuses while one runs there.
"""
from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("export", help="write a training checkpoint as a HuggingFace folder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the `flexfloor train --out` folder")
    p.add_argument("--step", type=int, help="the checkpoint of this step, >= 0 (default: the latest)")
    p.add_argument("--to", help="the HuggingFace folder to write (default: OUT/hf)")
    p.add_argument("--shard-gb", type=float, default=None,
                   help="largest safetensors file, in GB: a positive number (default 5, as HuggingFace "
                        "uploads use)")
    p.add_argument("--allow-unverified-checkpoint", action="store_true",
                   help="export a checkpoint that has no checksums.json (only one you trust)")
