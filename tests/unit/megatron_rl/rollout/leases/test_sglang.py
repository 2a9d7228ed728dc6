"""The sglang lease's state machine, on a fake engine (sglang itself runs in tests/gpu/)."""
import threading
import time
from concurrent.futures import Future

import pytest

from megatron_rl.data.arith import make_problems, write_jsonl
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.errors import FlexFloorError
from megatron_rl.rollout.leases.sglang import RELEASED, SERVING, SGLangSidecarJob, require_sglang
from megatron_rl.rollout.leases.sidecar import SGLangConfig, SidecarConfig

GIB = 2**30


class FakeEngine:
    """Answers arithmetic right after `delay_s`, on a device of `capacity` bytes whose engine holds
    `footprint` while resumed; records every call so the tests can check the order."""

    def __init__(self, delay_s=0.0, capacity=10 * GIB, footprint=2 * GIB, leak=0):
        self.tok = CharTokenizer()
        self.delay_s, self.capacity, self.footprint, self.leak = delay_s, capacity, footprint, leak
        self.used = footprint  # created holding its memory, like sglang.Engine
        self.calls, self.live, self.others = [], [], 0

    def free_bytes(self):
        return self.capacity - self.used - self.others

    def resume(self):
        self.calls.append("resume")
        self.used += self.footprint

    def release(self):
        self.calls.append("release")
        assert not self.live, "released with requests running"
        self.used -= self.footprint - self.leak

    def submit(self, input_ids, max_new_tokens):
        assert self.calls[-1] == "resume" or self.calls[-1] == "submit", self.calls
        self.calls.append("submit")
        fut = Future()
        answer = str(eval(self.tok.decode(input_ids[1:]).rstrip("=")))  # noqa: S307 - our own digits
        self.live.append(fut)

        def finish():
            if not fut.done():
                fut.set_result((self.tok.encode_response(answer), True))
                self.live.remove(fut)
        threading.Timer(self.delay_s, finish).start() if self.delay_s else finish()
        return fut

    def abort_all(self):
        self.calls.append("abort")
        for fut in list(self.live):
            fut.set_result(([], False))
            self.live.remove(fut)


@pytest.fixture
def cfg(tmp_path):
    write_jsonl(make_problems(12, seed=2, max_operand=9), tmp_path / "q.jsonl")
    return SidecarConfig("unused-by-the-fake", str(tmp_path / "q.jsonl"), batch=4,
                         sglang=SGLangConfig(drain_s=0.05))


def stop_after(seconds):
    end = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= end


def test_starts_released_then_serves_between_resume_and_release(cfg):
    fake = FakeEngine()
    job = SGLangSidecarJob(cfg, engine_factory=lambda: fake)
    seen = []
    job.run(lambda: seen.append(job.state) or len(seen) > 20)
    assert fake.calls[0] == "release" and fake.calls[1] == "resume" and fake.calls[-1] == "release"
    assert job.footprint == 2 * GIB and job.state == RELEASED and SERVING in seen
    rep = job.report()
    assert rep["served"] > 12 and rep["distinct"] == 12 and rep["accuracy"] == 1.0
    assert fake.used == 0  # nothing held once the lease returned


def test_preemption_drains_then_aborts_and_requeues(cfg):
    fake = FakeEngine(delay_s=5.0)  # no query can finish within the 0.05 s drain
    job = SGLangSidecarJob(cfg, engine_factory=lambda: fake)
    start = time.perf_counter()
    job.run(stop_after(0.05))
    assert time.perf_counter() - start < 1.0  # bounded by drain_s, not by the running queries
    assert "abort" in fake.calls and fake.calls[-1] == "release"
    rep = job.report()
    assert rep["served"] == 0 and rep["restarts"] == 4 and rep["queued"] == 12  # nothing lost
    fake.delay_s = 0.0
    job.run(lambda: job.queue.passes > 1)
    assert job.report()["distinct"] == 12 and job.report()["accuracy"] == 1.0


def test_no_lease_without_the_engines_footprint_free(cfg):
    fake = FakeEngine()
    job = SGLangSidecarJob(cfg, engine_factory=lambda: fake)
    fake.others = 9 * GIB  # the rollout's KV cache and experts leave 1 GiB; the engine needs 2
    job.run(lambda: False)
    assert job.report()["skipped_no_memory"] == 1 and "resume" not in fake.calls and job.state == RELEASED


def test_a_release_that_keeps_memory_is_an_error(cfg):
    job = SGLangSidecarJob(cfg, engine_factory=lambda: FakeEngine(leak=GIB))
    with pytest.raises(RuntimeError, match="kept 1024 MiB after release_memory_occupation"):
        job.run(stop_after(0.02))


def test_cpu_refusal_is_one_line(cfg):
    import torch

    from megatron_rl.config import load_dataclass
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout_runner import prepare

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    line = r"^leases: 'sglang' needs a CUDA GPU \(none is visible\); use 'sidecar' on CPU$"
    with pytest.raises(FlexFloorError, match=line):
        require_sglang()
    rollout = load_dataclass(RolloutConfig, None, {"policy": "natural", "leases": ["sglang"],
                                                   "sidecar.checkpoint": "m", "sidecar.queries": cfg.queries})
    with pytest.raises(FlexFloorError, match=line):
        prepare(rollout)
