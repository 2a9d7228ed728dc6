"""Which device a rank computes on and which process-group backend its world uses.

`device: auto | cpu | cuda` in the rollout and trainer configs. `auto` is cuda when
`torch.cuda.is_available()`; `cuda` on a machine without one is a user error (one line, exit 2).
One rank per GPU: a torchrun rank takes `cuda:LOCAL_RANK`, a spawned rank `cuda:rank`. The world is
NCCL on GPUs, gloo on CPU, and gloo also when ranks share a GPU through the host-staged transport
(`transport: host`, elastic/runtime/transport.py), because NCCL refuses two ranks on one device.
"""
from __future__ import annotations

import os
from typing import Literal

import torch

from megatron_rl.errors import FlexFloorError

DeviceChoice = Literal["auto", "cpu", "cuda"]
TransportChoice = Literal["direct", "host"]


def resolve_device(choice: str, where: str = "device") -> str:
    """'cpu' or 'cuda' for a config's `device` value; `where` names the field in the error.

    In a Slurm job `auto` and `cuda` without a visible GPU stop (a job that asked for no GPUs
    would otherwise run a GPU-sized config on gloo ranks); only `cpu` runs there on CPU."""
    job = os.environ.get("SLURM_JOB_ID")
    if choice in ("auto", "cuda") and job and not torch.cuda.is_available():
        raise FlexFloorError(f"{where}: {choice!r} but Slurm job {job} shows no GPU: submit with "
                             "--gpus-per-node=N, or set device: cpu (FF_DEVICE=cpu) for a CPU run")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise FlexFloorError(f"{where}: 'cuda' but no CUDA device is visible (torch {torch.__version__}, "
                             f"{build}); use device: cpu or auto")
    if choice not in ("cpu", "cuda"):
        raise FlexFloorError(f"{where}: expected one of 'auto', 'cpu', 'cuda', got {choice!r}")
    return choice


def dist_backend(device: str, transport: str = "direct") -> str:
    return "nccl" if device == "cuda" and transport == "direct" else "gloo"


def rank_device(device: str, rank: int, transport: str = "direct") -> torch.device:
    """This rank's compute device: `cuda:LOCAL_RANK` under torchrun, `cuda:rank` when spawned here.

    With the direct transport every rank needs a GPU of its own; the host-staged one lets ranks
    share (rank r on GPU r mod count), which is what the one-GPU elastic check runs on.
    """
    if device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    count = torch.cuda.device_count()
    if transport == "host":
        return torch.device("cuda", local % count)
    if local >= count:
        raise FlexFloorError(f"rank {rank} (local rank {local}) has no GPU of its own: {count} visible; NCCL "
                             "needs one GPU per rank (start fewer ranks per node, or `transport: host` to "
                             "share a GPU in tests)")
    return torch.device("cuda", local)


def nccl_environment() -> None:
    """torchtitan's settings: a lost peer or a stuck collective becomes an error that ends the rank
    (3: tear down the process group and raise), and a timeout dumps NCCL's flight recorder."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
