"""What a CUDA graph of the decode step captures is safe to replay, checked on CPU (tools/capture_safety.py):
no host read, data-dependent shape, RNG op or host-to-device copy inside the region; the same trace
for different inputs; and `DecodeRunner._key()` changes exactly when the storages the region reads do.
Negative controls: a host read, a random draw and a host tensor injected into the region fail the
check; on a key that leaves out the RoPE tables and the fp32 router copies the snapshot test fails."""
import gc

import pytest
import torch

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel, qwen3_moe
from megatron_rl.models.moe import grouped_mm_ok
from megatron_rl.rollout.decode_step import DecodeOptions
from megatron_rl.rollout.elastic_engines.torch_engine import ElasticRolloutEngine
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.kv.kind import kv_kind
from megatron_rl.rollout.sampling import SamplingParams
from tools import capture_safety

CFG = MoEModelConfig(num_layers=2, hidden_size=64, num_moe_experts=8, moe_router_topk=2, vocab_size=256)


def engine(dtype=torch.bfloat16, batch=20, kv="slots"):
    m = Qwen3MoeModel(CFG, dtype=dtype)
    m.init_weights(0)
    return RolloutEngine(m.eval(), SamplingParams(), batch, 40, kv=kv_kind(kv), decode=DecodeOptions(pad=True))


@pytest.mark.parametrize("kv", ["slots", "paged"])
def test_every_bucket_of_the_decode_step_is_capture_safe(kv):
    """Either KV cache: the paged one's block table is read on the device, never on the host."""
    out = capture_safety.check(engine(kv=kv))
    assert out["ok"], out["violations"]
    assert out["buckets"] == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("inject, found", [
    (lambda x: x + float(x.sum()), "host read"),
    (lambda x: x + torch.rand_like(x), "random numbers"),
    (lambda x: x + torch.tensor([0.0], dtype=x.dtype), "host-to-device data"),
    (lambda x: x[x > 1e9].sum() + x, "data-dependent shape"),
])
def test_a_region_that_reads_the_host_draws_or_copies_in_fails(monkeypatch, inject, found):
    eng = engine()
    norm = eng.model.decoder.final_layernorm
    forward = type(norm).forward
    monkeypatch.setattr(type(norm), "forward", lambda self, x: inject(forward(self, x)))
    out = capture_safety.check(eng)
    assert not out["ok"] and any(found in v for v in out["violations"]), out["violations"]


def test_a_value_baked_from_the_inputs_makes_the_traces_differ(monkeypatch):
    """A Python number taken from the batch (here the number of real rows, read on the host)
    passes the op checks but changes the trace between two inputs of one bucket."""
    eng = engine()
    runner = eng.runner
    real_forward = runner._forward

    def baked(n, L, run, masked):
        rows = sum(1 for r in runner._host[:n].tolist() if r[1] != eng.cache.scratch)  # outside the mode's reach
        return real_forward(n, L, run, masked)[:, : eng.model.config.vocab_size - (rows > 0)]

    monkeypatch.setattr(runner, "_forward", baked)
    out = capture_safety.check(eng)
    assert not out["ok"] and any("traces of two inputs differ" in v for v in out["violations"]), out


def test_the_graph_key_changes_exactly_when_what_the_graph_reads_does():
    eng = engine()
    runner = eng.runner
    el = ElasticRolloutEngine(eng, world=1)

    def evict_rope():
        qwen3_moe._rope_table.cache_clear()

    def move_router():  # the weight moved: its fp32 copy is made anew
        eng.model.moe_layers[0].router._fp32 = None

    def expert_out_and_back():  # the stacked copies are rebuilt
        flat = el.export_expert(3).clone()
        el.drop_expert(3)
        el.import_expert(3, flat)

    def kv_out_and_back():
        el.release_memory()
        el.reclaim_memory()

    changes = [("nothing", lambda: None), ("RoPE table evicted", evict_rope), ("router weight moved", move_router),
               ("KV released and reclaimed", kv_out_and_back),
               ("expert out and back", expert_out_and_back), ("nothing again", lambda: None)]
    before_reads, before_key = capture_safety.reads(runner), runner._key()
    held = []  # every tensor alive before a change stays alive: a new one cannot take a freed address
    for name, change in changes:
        held.extend(o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter))
        change()
        reads, key = capture_safety.reads(runner), runner._key()
        assert (reads != before_reads) == (key != before_key), f"{name}: reads changed {reads != before_reads}, " \
                                                               f"key changed {key != before_key}"
        assert (name.startswith("nothing")) == (reads == before_reads), name
        before_reads, before_key = reads, key


def test_grouped_mm_runs_on_cuda_majors_9_and_10_only(monkeypatch):
    ok = grouped_mm_ok.__wrapped__
    for major, want in ((8, False), (9, True), (10, True), (12, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device, m=major: (m, 0))
        assert ok(torch.bfloat16, torch.device("cuda", 0)) is want, major
    assert not ok(torch.float32, torch.device("cuda", 0))


@pytest.mark.parametrize("name", ["small", "30b-slice"])
def test_the_graphed_forward_traces_in_bf16_on_meta_at_every_bucket(monkeypatch, name):
    """The graphed region at every bucket up to 256, in bf16 on the meta device with the grouped
    GEMM on: `torch._grouped_mm`'s meta kernel holds CUDA's rules (2-D x 3-D, strides in multiples
    of 16 bytes, int32 offsets), which the CPU kernel does not, for the GPU check's two models."""
    from megatron_rl.models import moe
    from tools.bench_gpu import model_configs

    mcfg = model_configs()[name]
    with torch.device("meta"):
        m = Qwen3MoeModel(mcfg, None, torch.bfloat16).eval()
    monkeypatch.setattr(moe, "grouped_mm_ok", lambda dtype, device: dtype == torch.bfloat16)
    calls = []
    grouped = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    eng = RolloutEngine(m, SamplingParams(), 256, 48, decode=DecodeOptions(pad=True, attention="torch"))
    for n in eng.runner.buckets:
        with torch.inference_mode():
            logits = eng.runner._forward(n, eng.cache.max_len, None, masked=True)
        assert logits.shape == (n, mcfg.vocab_size) and logits.dtype == torch.bfloat16
    assert len(calls) == 2 * mcfg.num_layers * len(eng.runner.buckets)
