"""Decode tokens/s of our engine against HF `transformers` `generate` on one GPU, at batch 1 and 64.

    python tools/bench_gpu.py                       # cuda, bfloat16, batches 1 and 64
    python tools/bench_gpu.py --device cpu --dtype float32 --batches 1 4 --new-tokens 8 --reps 1

Check (c) of tools/gpu_check.sh. Both engines run the same random `Qwen3MoeForCausalLM` weights
(4 layers, hidden 512, 64 experts, top-8 by default: the model of check (a)) on the same device, in
the same dtype, on the same prompts, greedy, exactly `--new-tokens` new tokens; the measurement per
batch size is tools/bench_engine.py's (paired repetitions, decode time t(N) - t(1), wall clock).
Prints one side-by-side row per batch size and, with $FF_GPU_RESULTS set, records one result each.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import bench_engine  # noqa: E402
from tools.gpu_summary import record  # noqa: E402


def main(argv=None) -> int:
    p = bench_engine.parser()
    p.description = __doc__.splitlines()[0]
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.set_defaults(device="cuda", dtype="bfloat16", layers=4, hidden=512, experts=64, topk=8, vocab=4096,
                   new_tokens=64, reps=3)
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device visible; run it on a GPU machine (or pass --device cpu)", file=sys.stderr)
        return 2
    rows = []
    for batch in args.batches:
        args.batch = batch
        t0 = time.perf_counter()
        out = bench_engine.measure(args)
        ours, hf = out["decode_tokens_per_s"]["ours/wall"], out["decode_tokens_per_s"]["hf/wall"]
        lo, hi = out["ratio_range"]["wall"]
        rows.append((batch, ours, hf, out["ratio"]["wall"], lo, hi, out["same_tokens"]))
        record(f"c: decode tokens/s, batch {batch}", "pass",
               f"ours {ours:.0f}, HF generate {hf:.0f}: {out['ratio']['wall']:.2f}x "
               f"({lo:.2f}-{hi:.2f}x); {out['same_tokens']:.0%} equal greedy tokens", time.perf_counter() - t0)
    print(f"\ndecode tokens/s, {args.dtype} on {args.device} (wall clock, medians of {args.reps} paired reps)")
    print(f"{'batch':>5} {'ours':>10} {'HF generate':>12} {'ours/HF':>8} {'range':>13} {'equal tokens':>13}")
    for batch, ours, hf, ratio, lo, hi, same in rows:
        print(f"{batch:>5} {ours:>10.1f} {hf:>12.1f} {ratio:>7.2f}x {lo:>6.2f}-{hi:.2f}x {same:>12.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
