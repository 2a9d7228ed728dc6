"""Write a synthetic length trace (JSON Lines, the format of docs/design.md).

    python tools/make_trace.py --preset deepscaler --seed 0 --out runs/dsr.jsonl
    python tools/make_trace.py --preset nosignal --prompts 64 --epochs 4 --out ns.jsonl

Every `SynthParams` field is a flag (`--prompt-share 0.5`, `--hard-share 0.1`, ...); the
parameters and presets are described in docs/planner.md. In-process: `elastic.sim.synth.generate`.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.sim.synth import PRESETS, generate, preset
from elastic.trace import write_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="deepscaler")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="path of the JSON Lines trace to write")
    for f in dataclasses.fields(PRESETS["deepscaler"]):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                            help=f"override the preset's {f.name}")
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(PRESETS["deepscaler"])
                 if getattr(args, f.name) is not None}
    try:
        params = preset(args.preset, **overrides)
    except ValueError as e:
        parser.error(str(e))
    trace = generate(params, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_trace(trace, args.out)
    print(f"wrote {len(trace)} responses ({params.prompts} prompts x {params.samples} samples x "
          f"{params.epochs} epochs) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
