"""The synthetic traces tests plan, simulate and roll out on: built in-process (elastic/sim/synth.py,
what `tools/make_trace.py` writes) and written where a command reads a file."""
import json
import random
from pathlib import Path

from elastic.sim.synth import generate, preset
from elastic.trace import Trace, write_trace


def deepscaler(seed: int, **shape) -> Trace:
    """The `deepscaler` preset with `shape` (prompts, samples, epochs, cap, ...) replaced."""
    return generate(preset("deepscaler", **shape), seed=seed)


def small_deepscaler() -> Trace:
    """16 prompts x 4 samples x 3 epochs, capped at 4096 tokens: what the planning, simulate and
    megatron-planning tests plan on."""
    return deepscaler(1, prompts=16, samples=4, epochs=3, cap=4096)


def written(trace: Trace, path: Path) -> Path:
    """`trace` as a JSONL file at `path`, for the CLI."""
    write_trace(trace, path)
    return path


def write_tailed_trace(path: Path) -> Path:
    """A small length-tailed trace: 3 epochs x 8 prompts x 4 samples, lognormal lengths."""
    rng = random.Random(0)
    with path.open("w") as fh:
        for e in range(3):
            for p in range(8):
                mu = 7.0 + 0.35 * (p % 5)
                for s in range(4):
                    n = min(16384, int(rng.lognormvariate(mu, 0.6)))
                    fh.write(json.dumps({"prompt_id": f"p{p:02d}", "epoch": e, "sample": s,
                                         "prompt_len": 64 + p, "response_len": n,
                                         "truncated": n == 16384}) + "\n")
    return path


def write_flat_trace(path, response_len=8, epochs=2, extra=None):
    """8 prompts x 1 sample an epoch, every length 8 but prompt p0's `response_len`; `extra`, if
    given, a last line as it is (the bad-input tests' trace)."""
    with open(path, "w") as fh:
        for e in range(epochs):
            for p in range(8):
                fh.write(json.dumps({"prompt_id": f"p{p}", "epoch": e, "sample": 0, "prompt_len": 8,
                                     "response_len": response_len if p == 0 else 8}) + "\n")
        if extra:
            fh.write(extra + "\n")
    return path
