"""The sync-free, graph-captured decode engine on one CUDA GPU (issue 19; skipped without one). The
bodies are tools/gpu_decode_checks.py (their CPU side: tests/unit/test_gpu_decode_checks.py); each
records its row for the summary table (tools/gpu_summary.py) when $FF_GPU_RESULTS is set."""
import pytest
import torch

from tests.gpu.test_gpu_path import _check
from tools import gpu_decode_checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_check.sh)"),
    pytest.mark.timeout(300),
]


def test_c_decode_steps_raise_nothing_under_sync_debug_mode_error():
    out = _check("c: decode step, sync debug mode error", lambda: gpu_decode_checks.sync_free_steps(device="cuda"))
    assert out["ok"], out


def test_c_graph_replay_gives_the_eager_tokens_and_recaptures_after_changes():
    out = _check("c: graph replay = eager tokens (bf16)",
                 lambda: gpu_decode_checks.replay_matches_eager(device="cuda"))
    assert out["ok"], out


def test_b_bf16_identical_responses_per_policy():
    out = _check("b: bf16 responses per policy vs vanilla", lambda: gpu_decode_checks.bf16_policies(device="cuda"))
    assert out["ok"], out
