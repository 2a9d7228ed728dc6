"""The device of tests/gpu/'s megatron-core checks: one CUDA GPU, or in tools/gpu_check.sh's dry run
(FF_GPU_DRYRUN=1) the CPU, with megatron-core's real layers through the test harness
(tests/megatron_harness.py), so the megatron-train profile's `m:` rows run there as the default
profile's rows do."""
import pytest
import torch

from tools.gpu_env import DRYRUN


@pytest.fixture
def megatron_device(request) -> str:
    if DRYRUN:
        request.getfixturevalue("megatron_harness")
        return "cpu"
    torch.cuda.set_device(0)
    return "cuda"
