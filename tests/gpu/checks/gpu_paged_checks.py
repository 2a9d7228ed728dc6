"""The body of the paged KV cache's GPU check (tests/gpu/test_decode_engine_gpu.py runs it on CUDA),
written for any device so that tests/unit/tools/test_gpu_paged_checks.py runs it small on CPU.

`paged_vs_slot`: one batch of requests decoded by a slot-cache engine and by a paged-cache engine
on the same weights, both graph-captured on CUDA (the paged one through the Triton kernel's block
table): the responses must be the same (a response may part only at a near tie of the reference's
logits, as in gpu_decode_checks: the kernels add in the same order, so none is expected), the
decode steps raise nothing under `torch.cuda.set_sync_debug_mode("error")` (the block table is
written in place on the device, never read on the host), and the decode tokens/s of each,
measured after the prefill and one decode step, is the row's figure (recorded, not judged).
Distinct prompts, so both prefill the same rows; the paged pool holds every request's whole
length (no admission wait, no preemption), so both run the same batches.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from tests.gpu.checks.gpu_checks import SMALL_QWEN3_MOE, _model
from tests.gpu.checks.gpu_decode_checks import _near_tie


def _requests(n: int, vocab: int, new: int):
    """`n` prompts of 8..15 tokens, responses of new - n + 1 .. new tokens: the batch shrinks as they end."""
    from megatron_rl.rollout.engine import Request

    g = torch.Generator().manual_seed(2)
    return [Request(f"p{i}", 0, torch.randint(0, vocab, (8 + i % 8,), generator=g).tolist(), new - i % new,
                    fixed_len=new - i % new) for i in range(n)]


def _decode_rate(eng, reqs, device) -> tuple[dict, float]:
    """The responses, and the decode tokens/s after the prefill and the first decode step (which
    builds what is built once), those steps under sync debug mode "error" on CUDA."""
    eng.capture_graphs()
    eng.add(reqs)
    eng.step()  # the prefill of every request
    eng.step()
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    t0, tokens = time.perf_counter(), 0
    try:
        while eng.has_work():
            tokens += eng.step()
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    return {r.key: r.tokens for r in eng.finished}, tokens / (time.perf_counter() - t0)


def paged_vs_slot(mcfg=SMALL_QWEN3_MOE, *, device: str = "cuda", dtype=torch.bfloat16, batch: int = 64,
                  new: int = 120, max_len: int = 138, page_size: int = 16) -> dict:
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.kv.kind import kv_kind
    from megatron_rl.rollout.sampling import SamplingParams

    model = _model(mcfg, 0, dtype, device)
    reqs = _requests(batch, mcfg.vocab_size, new)
    out, rate = {}, {}
    for kv in ("slots", "paged"):
        eng = RolloutEngine(model, SamplingParams(greedy=True), batch, max_len,
                            kv=kv_kind(kv, page_size=page_size, reserve=0.0))
        kernel = eng.attention.kernel is not None  # the paged engine's, the last
        out[kv], rate[kv] = _decode_rate(eng, [replace(r, tokens=[]) for r in reqs], device)
    same = sum(out["paged"][k] == t for k, t in out["slots"].items())
    prompts = {r.key: r.prompt for r in reqs}
    ties = sum(_near_tie(model, prompts[k], t, out["paged"][k]) for k, t in out["slots"].items()
               if out["paged"][k] != t)
    ok = same + ties == len(reqs)
    return {"ok": ok, "same": same, "near_ties": ties, "responses": len(reqs), "tok_s": rate,
            "summary": f"batch {batch}, {same}/{len(reqs)} paged responses identical to the slot cache's "
                       f"({ties} more part at a near tie); decode tokens/s slots {rate['slots']:.0f}, paged "
                       f"{rate['paged']:.0f} ({rate['paged'] / rate['slots']:.2f}x; "
                       f"{'Triton kernel' if kernel else 'torch attention'}, pages of {page_size})"}
