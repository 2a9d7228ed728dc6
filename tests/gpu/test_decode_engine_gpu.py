"""The sync-free, graph-captured decode engine on one CUDA GPU (skipped without one), and
its paged KV cache against the slot one. The bodies are tests/gpu/checks/gpu_decode_checks.py
and gpu_paged_checks.py (their CPU side: tests/unit/tools/test_gpu_decode_checks.py and
test_gpu_paged_checks.py); each
records its row for the summary table (tools/gpu_summary.py) when $FF_GPU_RESULTS is set. In the dry
run the paged check runs in fp32 with the Triton kernel in the interpreter (tests/triton_interpreter.py),
so that its evidence, the kernel's launches, is real there too."""
import contextlib

import pytest
import torch

from tests.gpu.checks import gpu_decode_checks, gpu_paged_checks
from tests.gpu.checks.gpu_checks import SMALL_QWEN3_MOE
from tests.gpu.test_gpu_path import _check
from tests.triton_interpreter import interpreted
from tools.gpu_env import DEVICE, DRYRUN, needs_gpu, sized

pytestmark = [
    pytest.mark.gpu,
    needs_gpu,
    pytest.mark.timeout(300),
]


def test_c_the_captured_region_reads_no_host_data_and_bakes_no_value():
    out = _check("c: capture safety", lambda: gpu_decode_checks.capture_safe(
        sized(SMALL_QWEN3_MOE), device=DEVICE, **({"batch": 8} if DRYRUN else {})))
    assert out["ok"], out


def test_c_decode_steps_raise_nothing_under_sync_debug_mode_error():
    out = _check("c: decode step, sync debug mode error", lambda: gpu_decode_checks.sync_free_steps(
        sized(SMALL_QWEN3_MOE), device=DEVICE, **({"batch": 8, "steps": 2} if DRYRUN else {})))
    assert out["ok"], out


def test_c_graph_replay_gives_the_eager_tokens_and_recaptures_after_changes():
    out = _check("c: graph replay = eager tokens (bf16)",
                 lambda: gpu_decode_checks.replay_matches_eager(sized(SMALL_QWEN3_MOE), device=DEVICE,
                                                                **({"batch": 8} if DRYRUN else {})))
    assert out["ok"], out


def test_b_bf16_identical_responses_per_policy():
    out = _check("b: bf16 responses per policy vs vanilla", lambda: gpu_decode_checks.bf16_policies(
        device=DEVICE, **({"prompts": 2, "samples": 2, "policies": gpu_decode_checks.POLICIES[:2]} if DRYRUN else {})))
    assert out["ok"], out


def test_k_paged_decode_gives_the_slot_tokens_at_batch_64():
    small = {"batch": 4, "new": 6, "max_len": 24, "dtype": torch.float32} if DRYRUN else {}
    with interpreted() if DRYRUN else contextlib.nullcontext():
        out = _check("k: paged vs slot KV, decode batch 64", lambda: gpu_paged_checks.paged_vs_slot(
            sized(SMALL_QWEN3_MOE), device=DEVICE, **small))
    assert out["ok"], out
