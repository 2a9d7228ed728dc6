"""The paged KV cache's GPU check (tests/gpu/checks/gpu_paged_checks.py) runs small on CPU: the same
engines, without graphs or the Triton kernel (tests/gpu/test_decode_engine_gpu.py runs it on CUDA)."""
import torch

from tests.gpu.checks import gpu_paged_checks
from tests.gpu.checks.gpu_checks import TINY_QWEN3_MOE


def test_paged_vs_slot_on_cpu():
    out = gpu_paged_checks.paged_vs_slot(TINY_QWEN3_MOE, device="cpu", dtype=torch.float32, batch=6, new=6,
                                         max_len=24, page_size=4)
    assert out["ok"] and out["same"] == out["responses"] == 6, out
    assert set(out["tok_s"]) == {"slots", "paged"} and min(out["tok_s"].values()) > 0


def test_paged_vs_slot_fails_when_the_paged_responses_differ(monkeypatch):
    """Negative control: a paged attention that reads another row's values parts from the slot tokens."""
    from megatron_rl.rollout.kv.paged import PageRead

    gather = PageRead.gather
    monkeypatch.setattr(PageRead, "gather", lambda self, K, V, L: (gather(self, K, V, L)[0],
                                                                   gather(self, K, V, L)[1].roll(1, 0)))
    out = gpu_paged_checks.paged_vs_slot(TINY_QWEN3_MOE, device="cpu", dtype=torch.float32, batch=6, new=6,
                                         max_len=24, page_size=4)
    assert not out["ok"] and out["same"] < out["responses"], out
