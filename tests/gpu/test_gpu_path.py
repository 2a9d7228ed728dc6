"""Checks (a) and (b) of tools/gpu_check.sh on one CUDA GPU (skipped without one). The bodies are
tests/gpu/checks/gpu_checks.py, whose CPU side tests/unit/tools/test_gpu_checks.py runs; each check here records its
figures and its evidence (counts of what ran) for the summary table (tools/gpu_summary.py) when
$FF_GPU_RESULTS is set. The dry run of
tools/gpu_check.sh (FF_GPU_DRYRUN=1) runs them on CPU at tiny shapes (tools/gpu_env.py), not judged
(but for capture safety, which means the same on CPU)."""
import time

import pytest

from tests.gpu.checks import gpu_checks
from tools.gpu_env import DEVICE, DRYRUN, dryrun_detail, needs_gpu, sized
from tools.gpu_summary import record

pytestmark = [
    pytest.mark.gpu,
    needs_gpu,
    pytest.mark.timeout(300),
]


def _check(name: str, fn):
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:
        record(name, "fail", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", time.perf_counter() - t0)
        raise
    # The dry run checks paths, not tiny-model verdicts (capture safety is judged there too); in
    # both, a row passes only with evidence of what ran (gpu_summary.judged turns it into a failure).
    judged = out["ok"] or (DRYRUN and name != "c: capture safety")
    record(name, "pass" if judged else "fail", dryrun_detail(out["summary"]), time.perf_counter() - t0,
           evidence=out["evidence"])
    assert out["evidence"] and min(out["evidence"].values()) > 0, f"{name}: no evidence of what ran: {out}"
    return {**out, "ok": True} if DRYRUN and name != "c: capture safety" else out


def test_a_greedy_bf16_matches_the_fp64_reference_where_the_margin_is_large():
    out = _check("a: greedy bf16 vs fp64 CPU", lambda: gpu_checks.greedy_vs_reference(
        sized(gpu_checks.SMALL_QWEN3_MOE), device=DEVICE, **({"new_tokens": 8} if DRYRUN else {})))
    assert out["ok"], out


def test_a_five_grpo_steps_in_bf16_lower_the_loss():
    out = _check("a: 5 GRPO steps bf16", lambda: gpu_checks.grpo_steps(
        sized(gpu_checks.SMALL_QWEN3_MOE), device=DEVICE,
        **({"steps": 1, "prompts_per_step": 2, "group_size": 4, "max_response_len": 4} if DRYRUN else {})))
    assert out["ok"], out


def test_b_elastic_two_ranks_on_one_gpu_over_the_host_staged_transport():
    out = _check("b: 2-rank elastic, one GPU", lambda: gpu_checks.elastic_on_one_device(
        device=DEVICE, **({"prompts": 2, "samples": 2} if DRYRUN else {})))
    assert out["device"] == DEVICE and out["ok"], out
