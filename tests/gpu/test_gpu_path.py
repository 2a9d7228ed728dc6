"""Checks (a) and (b) of tools/gpu_check.sh on one CUDA GPU (skipped without one). The bodies are
tools/gpu_checks.py, whose CPU side tests/unit/test_gpu_checks.py runs; each check here records its
figures for the summary table (tools/gpu_summary.py) when $FF_GPU_RESULTS is set."""
import time

import pytest
import torch

from tools import gpu_checks
from tools.gpu_summary import record

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_check.sh)"),
    pytest.mark.timeout(300),
]


def _check(name: str, fn):
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:
        record(name, "fail", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", time.perf_counter() - t0)
        raise
    record(name, "pass" if out["ok"] else "fail", out["summary"], time.perf_counter() - t0)
    return out


def test_a_greedy_bf16_matches_the_fp64_reference_where_the_margin_is_large():
    out = _check("a: greedy bf16 vs fp64 CPU", lambda: gpu_checks.greedy_vs_reference(device="cuda"))
    assert out["ok"], out


def test_a_five_grpo_steps_in_bf16_lower_the_loss():
    out = _check("a: 5 GRPO steps bf16", lambda: gpu_checks.grpo_steps(device="cuda"))
    assert out["ok"], out


def test_b_elastic_two_ranks_on_one_gpu_over_the_host_staged_transport():
    out = _check("b: 2-rank elastic, one GPU", lambda: gpu_checks.elastic_on_one_device(device="cuda"))
    assert out["device"] == "cuda" and out["ok"], out
