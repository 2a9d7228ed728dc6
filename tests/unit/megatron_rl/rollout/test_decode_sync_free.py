"""A decode step reads device data on the host once (the chosen tokens), and the padded bucket path
of the CUDA graphs gives the unpadded step's tokens.

The count wraps every way the host reads a tensor's values (item, tolist, numpy, cpu, int/float/
bool/index conversion, boolean-mask indexing, nonzero) and torch.bincount (which syncs on CUDA to
size its output). On CPU nothing blocks, but the same code path runs on CUDA, where each of these
is a blocking sync. Negative control: on the engine before the sync-free step one decode step of the 4-layer
model at batch 64 made 10 such reads (RoPE's int(positions.max()), and per MoE layer a bincount and
its tolist), and this test failed there.
"""
import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.models.moe import LocalDispatcher
from megatron_rl.rollout.decode_step import DecodeOptions, batch_buckets
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams

READS = ("item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__", "__complex__",
         "nonzero", "__array__")


class _HostReads(TorchFunctionMode):
    """Sees every torch call made from Python while active (methods, dunders, functions)."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or name == "bincount":
            self.seen.append(name)
        elif name in ("__getitem__", "__setitem__") and len(args) > 1:
            parts = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                self.seen.append(f"{name}[bool mask]")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads():
    """Counts host reads of tensor data while active: yields a list that collects their names.
    A torch function mode, not patched methods: patching torch.Tensor.__getitem__ cannot be
    undone (CPython keeps the Python-level sequence slot), and torch.tensor() would then take 0-d
    tensors for sequences in every later test of the process."""
    seen: list = []
    with _HostReads(seen):
        yield seen


def model(dtype, layers=4):
    cfg = MoEModelConfig(num_layers=layers, hidden_size=64, num_moe_experts=8, moe_router_topk=2)
    m = Qwen3MoeModel(cfg, dtype=dtype)
    m.init_weights(0)
    return m.eval()


def requests(n, new=6, vary=False):
    def prompt(i):
        return torch.randint(0, 256, (3 + i % 5,), generator=torch.Generator().manual_seed(i)).tolist()

    return [Request(f"p{i}", 0, prompt(i), max_new_tokens=new, fixed_len=(2 + i % new) if vary else new)
            for i in range(n)]


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(greedy=False, top_p=0.9, seed=1)],
                         ids=["greedy", "top-p"])
def test_decode_step_reads_the_device_once(sampling):
    eng = RolloutEngine(model(torch.float32), sampling, 64, 32)
    eng.add(requests(64))
    eng.step()  # prefill
    assert len(eng.live) == 64
    with host_reads() as seen:
        eng.step()  # one decode step
    assert seen == ["tolist"], f"a decode step read the device {len(seen)} times: {seen}"


def test_recording_log_probs_rides_in_the_tokens_copy():
    """Training's engine records each sampled token's log-prob: still one read per decode step, and
    the recorded values are the float64 log-softmax at the chosen token, bit for bit."""
    from megatron_rl.rl.rollout_phase.recording_engine import RecordingEngine

    m = model(torch.float64, layers=2)
    sampling = SamplingParams(greedy=False, top_p=0.9, seed=3)
    eng = RecordingEngine(m, sampling, 8, 32, temperature=0.7)
    eng.add(requests(8))
    eng.step()
    with host_reads() as seen:
        eng.step()
    assert seen == ["tolist"] * 3, seen  # the copy, and float64's per-expert loop's counts per layer
    while eng.has_work():
        eng.step()
    for r in eng.finished:
        ids = torch.tensor([r.prompt + r.tokens])
        with torch.no_grad():
            logits = m(ids)[0, len(r.prompt) - 1:-1]
        want = torch.log_softmax(logits.double() / 0.7, -1).gather(1, torch.tensor(r.tokens)[:, None])[:, 0]
        assert eng.logprobs[r.key] == pytest.approx(want.tolist(), abs=1e-9)
        assert len(eng.logprobs[r.key]) == len(r.tokens)


def test_float64_per_expert_loop_reads_its_counts_once_per_layer():
    """No grouped GEMM in float64: the per-expert loop reads its split sizes, one copy per layer."""
    eng = RolloutEngine(model(torch.float64), SamplingParams(), 16, 32)
    eng.add(requests(16))
    eng.step()
    with host_reads() as seen:
        eng.step()
    assert seen == ["tolist"] * 5


def run(m, reqs, max_batch, pad):
    eng = RolloutEngine(m, SamplingParams(), max_batch, 48, decode=DecodeOptions(pad=pad))
    eng.add(reqs)
    sizes = []
    while eng.has_work():
        if not eng.pending:
            sizes.append(len(eng.live))
        eng.step()
    return {r.key: r.tokens for r in eng.finished}, sizes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_bucket_gives_the_unpadded_tokens(dtype):
    """Requests of different lengths leave one by one, so the batch passes through sizes 1..40 and
    the padded path runs every bucket (1, 2, 4, 8, 16, 32, 40) with padding rows in it."""
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    m = model(dtype, layers=2)
    reqs = requests(40, new=40, vary=True)
    plain, sizes = run(m, reqs, 40, pad=False)
    padded, _ = run(m, requests(40, new=40, vary=True), 40, pad=True)
    assert padded == plain
    assert {s for s in sizes if s not in batch_buckets(40)}  # batches that really were padded
    assert set(batch_buckets(40)) - {1} <= {min(b for b in batch_buckets(40) if b >= s) for s in sizes}


def test_misrouted_rows_raise_at_the_readback():
    m = model(torch.float32, layers=2)
    for moe in m.moe_layers:
        moe.experts.drop(3)  # expert 3 moved away, but the router still picks it here
    eng = RolloutEngine(m, SamplingParams(), 8, 32)
    assert isinstance(m.moe_layers[1].dispatcher, LocalDispatcher)
    eng.add(requests(8))
    held = r"\(it holds \[0, 1, 2, 4, 5, 6, 7\]\)"
    with pytest.raises(RuntimeError, match=r"rows routed to experts this rank does not hold " + held):
        while eng.has_work():
            eng.step()
