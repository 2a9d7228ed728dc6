"""Single-rank decode speed: our RolloutEngine against HuggingFace `generate`, side by side.

    python tools/bench_engine.py                  # defaults: batch 8, prompt 16, 64 new tokens, 5 reps
    python tools/bench_engine.py --batch 16 --new-tokens 128 --reps 5

Both run the same tiny random `transformers.Qwen3MoeForCausalLM` in float32 (ours loaded from its
`save_pretrained` directory with `load_hf_checkpoint`), the same prompts, the same batch size, greedy,
exactly `--new-tokens` new tokens per response (HF: `min_new_tokens = max_new_tokens`). One warm-up
run of each is discarded; then the two alternate for `--reps` repetitions. Decode tokens/s excludes
prefill: it is `B x (N - 1)` over `t(N new tokens) - t(1 new token)`, on the wall clock and on this
process's CPU clock. Each engine's line gives the medians over the repetitions. The ratio is paired:
every repetition times both engines back to back, its ratio compares those two, and the median of
the per-repetition ratios is reported (with their range), so a slow spell of a shared machine, which
hits both engines of one repetition alike, does not land on one side only. The greedy tokens of
both are compared too: a speed-up that changed the tokens would be no speed-up (in float32; in
bfloat16 on a GPU the kernels differ, and the share of equal tokens is reported instead).
`--device cuda --dtype bfloat16` runs the same comparison on a GPU (tools/bench_gpu.py does).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.rollout.kv.kind import KV_CACHES, kv_kind  # noqa: E402
from tools.tool_args import add_decode_args, add_model_args  # noqa: E402

DTYPES = ("float32", "bfloat16")  # torch dtype names


def tiny_hf(args):
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, moe_intermediate_size=args.hidden // 2, num_experts=args.experts,
        num_experts_per_tok=args.topk, norm_topk_prob=True, initializer_range=0.2,
        max_position_embeddings=args.prompt_len + args.new_tokens + 8)
    torch.manual_seed(args.seed)
    return transformers.Qwen3MoeForCausalLM(cfg).eval().to(args.device, getattr(torch, args.dtype))


def ours_generate(model, prompts, new_tokens, kv="slots"):
    from megatron_rl.rollout.engine import Request, RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    eng = RolloutEngine(model, SamplingParams(greedy=True), max_batch=len(prompts),
                        max_len=len(prompts[0]) + new_tokens, kv=kv_kind(kv))
    eng.add([Request(f"p{i}", 0, p, max_new_tokens=new_tokens, fixed_len=new_tokens)
             for i, p in enumerate(prompts)])
    while eng.has_work():
        eng.step()
    return [r.tokens for r in sorted(eng.finished, key=lambda r: int(r.prompt_id[1:]))]


def hf_generate(model, prompts, new_tokens):
    import torch

    ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def timed(fn, *a) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): on a shared machine the CPU time is the steadier."""
    w, c = time.perf_counter(), time.process_time()
    fn(*a)
    return time.perf_counter() - w, time.process_time() - c


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_decode_args(p, batch=8, prompt_len=16, new_tokens=64)
    p.add_argument("--reps", type=int, default=5)
    add_model_args(p, layers=2, hidden=64, experts=8, topk=2, vocab=256)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (both engines on it)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--kv", default="slots", choices=KV_CACHES, help="our engine's KV cache (rollout/kv/)")
    return p


def measure(args) -> dict:
    """Run both engines; print their lines and return the figures (decode tokens/s per engine and
    clock, the paired ratios, the share of equal greedy tokens)."""
    import torch

    from megatron_rl.models import load_hf_checkpoint

    torch.set_num_threads(args.threads)
    hf = tiny_hf(args)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_hf_checkpoint(d, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=g).tolist()
    B, N = args.batch, args.new_tokens
    print(f"config: Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-"
          f"{args.topk}, vocab {args.vocab}, {args.dtype} on {args.device}, {args.threads} thread(s); batch "
          f"{B}, prompt {args.prompt_len}, {N} new tokens, kv {args.kv}, greedy, {args.reps} reps after 1 warm-up; "
          f"torch {torch.__version__}")

    engines = {"ours": lambda n: ours_generate(ours, prompts, n, args.kv), "hf": lambda n: hf_generate(hf, prompts, n)}
    tokens = {name: fn(N) for name, fn in engines.items()}  # warm-up, and the tokens to compare
    for fn in engines.values():
        fn(1)
    full = {name: [] for name in engines}
    one = {name: [] for name in engines}
    for _ in range(args.reps):
        for name, fn in engines.items():
            full[name].append(timed(fn, N))
            one[name].append(timed(fn, 1))
    out = {"decode_tokens_per_s": {}, "ratio": {}, "ratio_range": {}}
    for name in engines:
        for i, clock in enumerate(("wall", "cpu")):
            t_full = statistics.median(t[i] for t in full[name])
            t_one = statistics.median(t[i] for t in one[name])
            rate = B * (N - 1) / max(t_full - t_one, 1e-9)
            out["decode_tokens_per_s"][f"{name}/{clock}"] = rate
            print(f"{name:>4} {clock:>4}: {B * N / t_full:9.1f} tokens/s end to end, {rate:9.1f} "
                  f"decode tokens/s (median {t_full * 1e3:.1f} ms for {N} tokens, {t_one * 1e3:.1f} ms for 1)")
    pairs = [(a, b) for ra, rb in zip(tokens["ours"], tokens["hf"]) for a, b in zip(ra, rb)]
    out["same_tokens"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
    print(f"greedy tokens identical: {out['same_tokens'] == 1} ({out['same_tokens']:.1%} of tokens equal)")
    for i, clock in enumerate(("wall", "cpu")):
        # Decode time of each engine in repetition k; their quotient is that repetition's speed ratio.
        decode = {name: [f[i] - o[i] for f, o in zip(full[name], one[name])] for name in engines}
        ratios = sorted(h / max(o, 1e-9) for h, o in zip(decode["hf"], decode["ours"]))
        out["ratio"][clock], out["ratio_range"][clock] = statistics.median(ratios), (ratios[0], ratios[-1])
        print(f"decode tokens/s ratio ours / HF generate ({clock} clock): {statistics.median(ratios):.2f}x "
              f"(median of {len(ratios)} paired repetitions, range {ratios[0]:.2f}x-{ratios[-1]:.2f}x; "
              f"target >= 1.5x)")
    return out


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error(f"--new-tokens: expected >= 2 (decode time is t(N) - t(1)), got {args.new_tokens}")
    return 0 if measure(args)["same_tokens"] == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
