"""Where tools/gpu_check.sh's checks run: on CUDA, or in its dry run (`FF_GPU_DRYRUN=1`) on CPU at
tiny shapes, through the same Python paths (tests/gpu/, tools/bench_gpu.py, the megatron tools).

    from tools.gpu_env import DRYRUN, DEVICE, needs_cuda, needs_gpu, needs_megatron_device, sized
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

DRYRUN = os.environ.get("FF_GPU_DRYRUN") == "1"
DEVICE = "cpu" if DRYRUN else "cuda"

# A tests/gpu module's skip: without CUDA, unless this is the dry run (which runs it on CPU).
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() or DRYRUN),
                               reason="needs a CUDA GPU (tools/gpu_check.sh; FF_GPU_DRYRUN=1 runs it on CPU)")
# A check that needs CUDA even in the dry run (two GPUs, TransformerEngine).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# A megatron-core check's skip: without CUDA, unless this is the dry run, which builds megatron-core's
# layers on CPU through the test harness (tests/gpu/conftest.py: `megatron_device`) over gloo.
needs_megatron_device = pytest.mark.skipif(
    not (torch.cuda.is_available() or DRYRUN),
    reason="megatron-core's layers need CUDA (FF_GPU_DRYRUN=1 runs them on CPU through tests/megatron_harness.py)")
MEGATRON_DIST_BACKEND = "gloo" if DRYRUN else "nccl"  # for tests/conftest.py's one_rank_group fixture


def sized(mcfg):
    """`mcfg` as the check runs it: itself on the GPU, a 2-layer, 8-expert, hidden-64 copy in the dry run."""
    if not DRYRUN:
        return mcfg
    return replace(mcfg, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                   num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, vocab_size=256)


def dryrun_detail(detail: str) -> str:
    """A row's detail in the dry run says that its figures are CPU figures at tiny shapes, not judged."""
    return f"dry run (cpu, tiny): {detail}" if DRYRUN else detail
