"""The training rows of tools/gpu_check.sh on one CUDA GPU (skipped without one): bf16 against fp32
GRPO updates on the same rollouts, one row of figures per update (tools/grpo_precision.py, whose
CPU side tests/unit/tools/test_grpo_precision.py runs), and the offloaded optimizer step
(tools/bench_offload.py: step seconds and device bytes, DeepSpeed's CPU Adam against AdamW)."""
import time

import pytest

from tests.gpu.checks import gpu_checks
from tools import bench_offload, grpo_precision
from tools.gpu_env import DEVICE, DRYRUN, dryrun_detail, needs_gpu, sized
from tools.gpu_summary import record

pytestmark = [
    pytest.mark.gpu,
    needs_gpu,
    pytest.mark.timeout(300),
]


def test_a_bf16_grpo_updates_against_fp32_on_the_same_rollouts():
    t0 = time.perf_counter()
    small = {"steps": 1, "prompts_per_step": 2, "group_size": 4, "max_response_len": 4} if DRYRUN else {}
    out = grpo_precision.compare(device=DEVICE, mcfg=sized(gpu_checks.SMALL_QWEN3_MOE), **small)
    print(grpo_precision.table(out["rows"]))
    record("a: bf16 GRPO per-update table", "pass" if out["ok"] or DRYRUN else "fail",
           dryrun_detail(grpo_precision.summary(out["rows"])), time.perf_counter() - t0,
           evidence={"updates compared": len(out["rows"])})
    assert out["ok"] or DRYRUN, grpo_precision.table(out["rows"])


def test_o_offloaded_optimizer_step():
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        record("o: offloaded optimizer step", "skip", f"deepspeed is not importable here ({e})", 0)
        pytest.skip("optim.offload needs deepspeed (pip install -e '.[offload]')")
    t0 = time.perf_counter()
    r = bench_offload.measure(int(1e6) if DRYRUN else int(50e6), DEVICE, 5)
    d, o = r["device"], r["offload"]
    record("o: offloaded optimizer step", "pass",
           f"{r['params'] / 1e6:.0f} M params: step {d['step_s']:.3f} s on the GPU, {o['step_s']:.3f} s offloaded; "
           f"state on the GPU {d['device_state_bytes'] / 1e6:.0f} MB -> {o['device_state_bytes'] / 1e6:.0f} MB",
           time.perf_counter() - t0, evidence={"optimizer steps timed": 2 * 5})
    if DRYRUN:
        return  # on CPU the "device" state is host memory too
    assert o["device_state_bytes"] < d["device_state_bytes"] / 4
