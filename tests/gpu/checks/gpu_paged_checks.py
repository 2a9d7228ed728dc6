"""The body of the paged KV cache's GPU check (tests/gpu/test_decode_engine_gpu.py runs it on CUDA),
written for any device so that tests/unit/tools/test_gpu_paged_checks.py runs it small on CPU.

`paged_vs_slot`: one batch of requests decoded by a slot-cache engine, by a paged-cache engine and
by a paged-cache engine on the torch attention path, on the same weights, graph-captured on CUDA.
Where the Triton kernel runs (CUDA; the interpreter in the dry run) the first two use it, so their
agreement tests page addressing; the third reads the same pages through the torch path, so the
paged kernel's responses against it test the kernel. The kernel must have been launched (its
split kernel counted at capture or eagerly: `kernel` is the evidence, and a kernel expected but
never launched fails), and the responses must be the same (a response may part only at a near tie
of the reference's logits, as in gpu_decode_checks: the two kernel engines add in the same order,
so none is expected there). The decode steps raise nothing under
`torch.cuda.set_sync_debug_mode("error")` (the block table is written in place on the device,
never read on the host), and the decode tokens/s of the slot and paged kernel engines, measured
after the prefill and one decode step, is the row's figure (recorded, not judged). Distinct
prompts, so all prefill the same rows; the paged pool holds every request's whole length (no
admission wait, no preemption), so all run the same batches.
"""
from __future__ import annotations

import time
from dataclasses import replace
from unittest import mock

import torch

from megatron_rl.rollout import decode_attention
from tests.gpu.checks.gpu_checks import SMALL_QWEN3_MOE, _model
from tests.gpu.checks.gpu_decode_checks import _near_tie, counted_replays


class Launches:
    """A kernel that counts its launches (`kernel[grid](...)`) and runs them."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


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


def _parted(model, prompts: dict, want: dict, got: dict) -> tuple[int, int]:
    """(responses identical, responses parting only at a near tie) of `got` against `want`."""
    same = sum(got[k] == t for k, t in want.items())
    ties = sum(_near_tie(model, prompts[k], t, got[k]) for k, t in want.items() if got[k] != t)
    return same, ties


def paged_vs_slot(mcfg=SMALL_QWEN3_MOE, *, device: str = "cuda", dtype=torch.bfloat16, batch: int = 64,
                  new: int = 120, max_len: int = 138, page_size: int = 16, kernel: bool | None = None) -> dict:
    """`kernel` (default: where `decode_attention.available`): the Triton kernel must run."""
    from megatron_rl.rollout.decode_step import DecodeOptions
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.kv.kind import kv_kind
    from megatron_rl.rollout.sampling import SamplingParams

    model = _model(mcfg, 0, dtype, device)
    expect = decode_attention.available(torch.device(device), mcfg.kv_channels, dtype) if kernel is None else kernel
    reqs = _requests(batch, mcfg.vocab_size, new)
    out, rate, launches = {}, {}, {}
    with counted_replays() as replays:
        for kv, attention in (("slots", "auto"), ("paged", "auto"), ("paged", "torch")):
            eng = RolloutEngine(model, SamplingParams(greedy=True), batch, max_len,
                                kv=kv_kind(kv, page_size=page_size, reserve=0.0),
                                decode=DecodeOptions(attention=attention))
            with mock.patch.object(decode_attention, "_split_kernel",
                                   Launches(decode_attention._split_kernel)) as counted:
                out[kv, attention], rate[kv, attention] = _decode_rate(eng, [replace(r, tokens=[]) for r in reqs],
                                                                       device)
            launches[kv, attention] = counted.n
    prompts = {r.key: r.prompt for r in reqs}
    same, ties = _parted(model, prompts, out["slots", "auto"], out["paged", "auto"])
    same_torch, ties_torch = _parted(model, prompts, out["paged", "torch"], out["paged", "auto"])
    ran = launches["paged", "auto"]
    ok = same + ties == len(reqs) and same_torch + ties_torch == len(reqs) and (ran > 0 or not expect) \
        and launches["paged", "torch"] == 0
    evidence = {"responses compared": 2 * len(reqs)}
    if expect:
        evidence["paged kernel launches"] = ran
    if torch.device(device).type == "cuda":
        evidence["graph replays"] = replays.n
    slots, paged = rate["slots", "auto"], rate["paged", "auto"]
    return {"ok": ok, "same": same, "near_ties": ties, "same_as_torch_path": same_torch, "responses": len(reqs),
            "tok_s": {"slots": slots, "paged": paged}, "kernel_launches": ran, "evidence": evidence,
            "summary": f"batch {batch}, pages of {page_size}: {same}/{len(reqs)} paged responses identical to the "
                       f"slot cache's ({ties} more part at a near tie), {same_torch}/{len(reqs)} to the torch path "
                       f"on the same pages ({ties_torch} at a near tie); attention "
                       f"{f'Triton kernel ({ran} split launches)' if ran else 'torch (no kernel here)'}"
                       + ("" if ran or not expect else ", EXPECTED THE KERNEL")
                       + f"; decode tokens/s slots {slots:.0f}, paged {paged:.0f} ({paged / slots:.2f}x)"}
