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


def test_the_paged_kernel_must_run_where_it_is_expected():
    """Where the kernel runs (here the interpreter, fp32) its launches are the row's evidence, and
    its responses equal the torch path's on the same pages; a kernel expected but never launched
    (CPU without the interpreter) fails the check."""
    from tests.triton_interpreter import interpreted

    small = dict(device="cpu", dtype=torch.float32, batch=4, new=5, max_len=16, page_size=4)
    with interpreted():
        out = gpu_paged_checks.paged_vs_slot(TINY_QWEN3_MOE, **small)
    assert out["ok"] and out["kernel_launches"] > 0 and out["same_as_torch_path"] == 4, out
    assert out["evidence"]["paged kernel launches"] == out["kernel_launches"]
    out = gpu_paged_checks.paged_vs_slot(TINY_QWEN3_MOE, **small, kernel=True)
    assert not out["ok"] and out["evidence"]["paged kernel launches"] == 0 and "EXPECTED THE KERNEL" in out["summary"]
