"""How the EP dispatcher's and the elastic runtime's tensors reach their collectives.

`direct`: as they are, on the compute device (NCCL moves GPU tensors, gloo CPU ones).
`host`: each tensor is copied into a host buffer, the collective runs over gloo on the host copy, and
the result is copied back onto the compute device. NCCL refuses two ranks on one GPU, so this is how
the one-GPU check (tests/gpu/) runs a 2-rank elastic rollout with CUDA compute; it costs two copies
per collective and is never used on a cluster. On CPU the copies still happen, so the staging code
runs, and is tested, without a GPU.

Every collective a rank makes through a transport is one call here, so both transports issue the
same sequence of collectives and give the same numbers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class DirectTransport:
    name = "direct"

    def all_reduce(self, t: torch.Tensor, group=None) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        """Rows of `x` split by `in_splits` go to the group's members; `out_splits` rows come back."""
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        dist.send(t, dst=dst, tag=tag)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        dist.recv(t, src=src, tag=tag)
        return t


def _host(t: torch.Tensor) -> torch.Tensor:
    """A fresh host copy (never a view of `t`, even on CPU: the copy is the code under test)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


class HostStagedTransport(DirectTransport):
    name = "host"

    def all_reduce(self, t: torch.Tensor, group=None) -> torch.Tensor:
        return t.copy_(super().all_reduce(_host(t), group))

    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        return super().all_to_all(_host(x), out_splits, in_splits, group).to(x.device, copy=True)

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        super().send(_host(t), dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        return t.copy_(super().recv(torch.empty(t.shape, dtype=t.dtype, device="cpu"), src, tag))


TRANSPORTS = {"direct": DirectTransport, "host": HostStagedTransport}


def make_transport(name: str) -> DirectTransport:
    return TRANSPORTS[name]()
