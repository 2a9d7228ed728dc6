"""Start a multi-rank CPU job: spawn W gloo ranks on this machine, or join a torchrun/Slurm world.

`run_ranks(fn, world, *args)` calls `fn(ctx, *args)` on every rank and returns rank 0's return
value. Started under torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set), the current process
is one rank of that world and non-zero ranks return None. Otherwise W processes are spawned; a rank
that raises or dies ends the whole job with an error naming the rank, after at most `timeout_s`.
"""
from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.errors import FlexFloorError
from megatron_rl.parallel.groups import ProcessGroups


class RankFailed(FlexFloorError):
    """A rank of a multi-rank job failed; the message names the rank and what it reported."""


@dataclass
class ParallelContext:
    rank: int
    world: int
    pgs: ProcessGroups
    timeout_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_context(timeout_s: float) -> ParallelContext:
    world_group = dist.group.WORLD
    pgs = ProcessGroups(world=world_group, ep=world_group, dp=world_group)
    return ParallelContext(dist.get_rank(), dist.get_world_size(), pgs, timeout_s)


def _init(rank: int, world: int, timeout_s: float) -> None:
    torch.set_num_threads(1)  # W ranks share this machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def _worker(rank, world, port, timeout_s, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        _init(rank, world, timeout_s)
        out = fn(_make_context(timeout_s), *args)
        queue.put((rank, "ok", out if rank == 0 else None))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        msg = str(e) if isinstance(e, FlexFloorError) else traceback.format_exc()
        queue.put((rank, "error", (type(e).__name__, msg)))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def run_ranks(fn: Callable, world: int, *args, timeout_s: float = 300.0):
    if under_torchrun():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init(rank, size, timeout_s)
        try:
            out = fn(_make_context(timeout_s), *args)
        finally:
            dist.destroy_process_group()
        return out if rank == 0 else None
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, timeout_s, fn, args, queue), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    result, errors, reported = None, [], set()
    try:
        while len(reported) < world:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except Exception:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in reported]
                if dead:
                    # A rank that died without reporting (killed, segfault): the others will time
                    # out on their next collective; report the first death, not the echoes.
                    errors.append((dead[0], "died", f"exit code {procs[dead[0]].exitcode}"))
                    break
                continue
            reported.add(rank)
            if status == "ok":
                result = payload if rank == 0 else result
            else:
                errors.append((rank, *payload))
                break
    finally:
        deadline_s = timeout_s if errors else 30.0
        for p in procs:
            p.join(timeout=deadline_s if not errors else 5.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if errors:
        rank, kind, msg = errors[0]
        raise RankFailed(f"rank {rank} failed ({kind}): {msg}".rstrip())
    return result
