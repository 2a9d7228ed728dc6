"""Capture safety (tools/capture_safety.py) over the Triton attention path, the default on CUDA: the
decode step with the Triton kernels in the interpreter (tests/triton_interpreter.py), slot and
paged cache. Each launch is one trace entry and the interpreter's own host copies are not traced,
so the region is safe; a host read planted in the step, or right around a kernel launch, is still
caught."""
import pytest
import torch

from megatron_rl.rollout import decode_attention
from tests.triton_interpreter import interpreted
from tests.unit.megatron_rl.rollout.test_capture_safety import engine
from tools import capture_safety


@pytest.fixture(autouse=True)
def interpreter():
    with interpreted():
        yield


@pytest.mark.parametrize("kv", ["slots", "paged"])
def test_the_triton_decode_step_is_capture_safe(kv):
    eng = engine(dtype=torch.float32, batch=4, kv=kv)
    out = capture_safety.check(eng)
    assert out["ok"], out["violations"]
    launches = [op[0] for op in capture_safety.trace_bucket(eng.runner, 4).ops if op[0].startswith("triton:")]
    layers = eng.model.config.num_layers
    assert launches == ["triton:_split_kernel", "triton:_merge_kernel"] * layers


def test_a_host_read_in_the_step_is_still_caught(monkeypatch):
    eng = engine(dtype=torch.float32, batch=4)
    norm = eng.model.decoder.final_layernorm
    forward = type(norm).forward
    monkeypatch.setattr(type(norm), "forward", lambda self, x: forward(self, x) + float(x.sum()) * 0)
    out = capture_safety.check(eng)
    assert not out["ok"] and any("host read" in v for v in out["violations"]), out


def test_a_host_read_next_to_a_kernel_launch_is_still_caught(monkeypatch):
    """Only the launch itself is left untraced: the Python that calls it is traced as ever."""
    eng = engine(dtype=torch.float32, batch=4)
    merge = decode_attention._merge_kernel

    class ReadsFirst:
        def __getitem__(self, grid):
            def launch(mid_o, *args, **kwargs):
                mid_o.sum().item()  # a blocking read a graph would bake in
                return merge[grid](mid_o, *args, **kwargs)
            return launch

    monkeypatch.setattr(decode_attention, "_merge_kernel", ReadsFirst())
    out = capture_safety.check(eng)
    assert not out["ok"] and any("host read" in v for v in out["violations"]), out
