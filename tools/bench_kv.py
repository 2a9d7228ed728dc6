"""The slot KV cache against the paged one, side by side in one run, on a length-tailed GRPO batch.

    python tools/bench_kv.py                      # DeepScaleR-like trace, 16 prompts x 8 samples
    python tools/bench_kv.py --preset eurus --budget-slots 8

Both engines get the same KV byte budget: `--budget-slots` sequences of the batch's longest
length (prompt + cap), which is exactly what the slot cache holds. The paged cache spends the same
bytes on pages of `--page-size` positions and admits requests by their predicted length (the
planner's per-response `--quantile` of its predictive length, from the trace's earlier epochs;
`reserved_lengths` in elastic/planning/lengths/guard.py), keeping `--reserve` of the pages free and
preempting the newest request when the pool runs out. Requests replay the trace's last epoch: the
response lengths times `--length-scale`, the prompts times `--prompt-scale` (random ids, one prompt
per GRPO group).

Per cache, one line: KV bytes allocated, peak concurrent requests, decode steps, prefill tokens
computed of those requested, pages shared, preemptions, decode tokens/s (decode tokens over the
wall time of the decode steps, on this CPU), and whether the tokens equal the slot cache's (greedy,
float64). The ratios paged/slots close the table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.tool_args import add_trace_args  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="deepscaler", help="synthetic trace preset (elastic/sim/synth.py)")
    add_trace_args(p, prompts=16, samples=8)
    p.add_argument("--length-scale", type=float, default=0.02)
    p.add_argument("--prompt-scale", type=float, default=0.25)
    p.add_argument("--budget-slots", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--quantile", type=float, default=0.5, help="predicted length quantile admission reserves")
    p.add_argument("--reserve", type=float, default=0.1)
    p.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    p.add_argument("--seed", type=int, default=0)
    return p


def batch(args):
    """The requests (their predicted lengths set) and the longest sequence."""
    from elastic.planning.lengths.guard import reserved_lengths
    from elastic.sim.synth import generate, preset
    from megatron_rl.models.config import MoEModelConfig
    from megatron_rl.rollout.batch import predicted_len, prompt_tokens, scaled_len, select_epoch
    from megatron_rl.rollout.engine import Request

    trace = generate(preset(args.preset, prompts=args.prompts, samples=args.samples, epochs=3), seed=args.seed)
    records, history = select_epoch(trace, None)
    reserved = reserved_lengths(records, history, tailguard=False, alpha=1 - args.quantile)
    vocab = MoEModelConfig().vocab_size
    reqs = []
    for r, q in zip(records, reserved):
        n = scaled_len(r.response_len, args.length_scale)
        prompt = prompt_tokens(args.seed, r.prompt_id, scaled_len(r.prompt_len, args.prompt_scale), vocab)
        reqs.append(Request(r.prompt_id, r.sample, prompt, n, fixed_len=n,
                            predicted_len=predicted_len(q, args.length_scale)))
    cap = scaled_len(max(trace.records, key=lambda r: r.response_len).response_len, args.length_scale)
    return reqs, max(len(r.prompt) for r in reqs) + cap


def run(model, reqs, max_len: int, args, kv: str) -> dict:
    import math
    from dataclasses import replace

    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.kv.kind import PagedKV
    from megatron_rl.rollout.sampling import SamplingParams

    if kv == "slots":
        engine = RolloutEngine(model, SamplingParams(), args.budget_slots, max_len)
    else:  # the same bytes in pages (the slot cache's scratch slot aside), a handle per request
        pages = args.budget_slots * math.ceil(max_len / args.page_size)
        engine = RolloutEngine(model, SamplingParams(), len(reqs), max_len,
                               kv=PagedKV(page_size=args.page_size, pages=pages, reserve=args.reserve))
    engine.add([replace(r, tokens=[]) for r in reqs])
    peak = steps = decode_tokens = 0
    decode_s = 0.0
    while engine.has_work():
        decoding = not (engine.pending and engine.scheduler.admissible())
        t0 = time.perf_counter()
        n = engine.step()
        if decoding:
            decode_s += time.perf_counter() - t0
            decode_tokens += n
            steps += 1
        peak = max(peak, len(engine.live))
    return {"kv": kv, "tokens": {r.key: r.tokens for r in engine.finished}, "peak": peak, "steps": steps,
            "decode_tps": decode_tokens / decode_s, **engine.kv_report()}


def main(argv=None) -> int:
    import torch

    from megatron_rl.models.config import MoEModelConfig
    from megatron_rl.models.qwen3_moe import Qwen3MoeModel

    args = parser().parse_args(argv)
    torch.manual_seed(args.seed)
    reqs, max_len = batch(args)
    model = Qwen3MoeModel(MoEModelConfig(), dtype=getattr(torch, args.dtype))
    model.init_weights(args.seed)
    model.eval()
    lengths = sorted(r.fixed_len for r in reqs)
    print(f"{args.preset}: {len(reqs)} requests ({args.prompts} prompts x {args.samples}), response median "
          f"{lengths[len(lengths) // 2]}, max {lengths[-1]}; longest sequence {max_len}; budget "
          f"{args.budget_slots} slots; page {args.page_size}; admission quantile {args.quantile}, reserve "
          f"{args.reserve}; {args.dtype}")
    out = [run(model, reqs, max_len, args, kv) for kv in ("slots", "paged")]
    print(f"{'cache':6} {'KV MiB':>8} {'peak req':>8} {'steps':>6} {'prefill computed':>17} {'shared':>7} "
          f"{'preempt':>7} {'decode tok/s':>12} {'tokens':>6}")
    for r in out:
        same = r["tokens"] == out[0]["tokens"]
        print(f"{r['kv']:6} {r['kv_bytes'] / 2**20:8.2f} {r['peak']:8d} {r['steps']:6d} "
              f"{r['prefill_tokens_computed']:7d} / {r['prefill_tokens_requested']:7d} {r['pages_shared']:7d} "
              f"{r['preemptions']:7d} {r['decode_tps']:12.0f} {'equal' if same else 'DIFFER':>6}")
    s, p = out
    print(f"paged / slots: KV bytes {p['kv_bytes'] / s['kv_bytes']:.2f}x, peak concurrent requests "
          f"{p['peak'] / s['peak']:.2f}x, decode steps {p['steps'] / s['steps']:.2f}x, prefill tokens computed "
          f"{s['prefill_tokens_computed'] / p['prefill_tokens_computed']:.2f}x fewer, decode tokens/s "
          f"{p['decode_tps'] / s['decode_tps']:.2f}x")
    return 0 if p["tokens"] == s["tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
