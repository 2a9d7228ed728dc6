"""Start a multi-rank job: spawn W ranks on this machine, or join a torchrun/Slurm world.

`run_ranks(fn, world, *args)` calls `fn(ctx, *args)` on every rank and returns rank 0's return
value. Started under torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set), the current process
is one rank of that world and non-zero ranks return None. Otherwise W processes are started (forked
from a fork server that imported torch once, parallel/rank_start.py); a rank
that raises or dies ends the whole job with one line naming the rank whose failure is the cause
(parallel/rank_failures.py), after at most `timeout_s`; a full disk ends it as `DiskFull`
(megatron_rl/parallel/disk_full.py: the CLI's "no space left on device: PATH", exit 1).
`device` ('cpu' or 'cuda', see parallel/device.py) picks the world's backend: gloo or NCCL.
"""
from __future__ import annotations

import gc
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from elastic.errors import shorten
from elastic.runtime.groups import forget as forget_groups
from elastic.runtime.runtime import ElasticFault
from megatron_rl.errors import FlexFloorError, Interrupted
from megatron_rl.parallel.device import dist_backend, nccl_environment, rank_device
from megatron_rl.parallel.rank_failures import RankFailure, describe, failure_of, user_error
from megatron_rl.parallel.rank_start import rank_context, worker_environment
from megatron_rl.parallel.signals import GRACE_S, Supervisor, default_signals, rank_signals
from megatron_rl.parallel.torchrun import TORCHRUN_VARS, under_torchrun


class RankFailed(FlexFloorError):
    """A rank of a multi-rank job failed; the message names the rank and what it reported."""


@dataclass
class ParallelContext:
    rank: int
    world: int
    timeout_s: float
    store: object  # the job's key-value store (control messages that must not block a rank)
    device: torch.device  # where this rank computes (parallel/device.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_context(timeout_s: float, device: torch.device) -> ParallelContext:
    # The default group's store: torch keeps it private, but every launcher (spawn, torchrun,
    # Slurm) creates one, and it is the only channel a rank can poll without blocking.
    store = dist.distributed_c10d._get_default_store()
    return ParallelContext(dist.get_rank(), dist.get_world_size(), timeout_s, store, device)


def _init(rank: int, world: int, timeout_s: float, device: str, transport: str) -> torch.device:
    """Join the world; returns this rank's compute device."""
    torch.set_num_threads(1)  # W ranks share this machine's cores
    here = rank_device(device, rank, transport)
    timeout = timedelta(seconds=timeout_s)
    if dist_backend(device, transport) == "nccl":
        # The device first, so NCCL's communicator (created eagerly for `device_id`) lands on it.
        torch.cuda.set_device(here)
        nccl_environment()
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=here)
    else:
        if here.type == "cuda":
            torch.cuda.set_device(here)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    return here


@dataclass(frozen=True)
class RankJob:
    """What every rank the launcher spawns is given: the call to make, the world to join (on
    127.0.0.1:`port`), the launcher it answers to, the environment it applies, and the folder the
    ranks write to (a full disk is named by it when the OS error names no file)."""

    fn: Callable
    args: tuple
    world: int
    port: int
    timeout_s: float
    launcher_pid: int
    env: dict
    device: str
    transport: str
    writes_to: str | Path | None


@dataclass(frozen=True)
class RankDone:
    rank: int
    result: object  # rank 0's return value (None on the other ranks)


def _worker(job: RankJob, rank: int, queue) -> None:
    worker_environment(job.env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port))
    rank_signals(job.launcher_pid)
    try:
        here = _init(rank, job.world, job.timeout_s, job.device, job.transport)
        out = job.fn(_make_context(job.timeout_s, here), *job.args)
        queue.put(RankDone(rank, out if rank == 0 else None))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        queue.put(failure_of(e, rank, job.writes_to))
        raise SystemExit(1) from None
    finally:
        leave_world()


def leave_world() -> None:
    """A rank's last step, on every launcher: back to default signals, then the world's groups end
    here (the group cache's references dropped, the world destroyed, cycles that still hold a
    backend collected), so no backend thread is left for the interpreter's finalization to meet."""
    default_signals()
    forget_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _join_torchrun(rank: int, size: int, timeout_s: float, device: str, transport: str) -> torch.device:
    try:
        return _init(rank, size, timeout_s, device, transport)
    except (RuntimeError, ValueError) as e:  # torch's DistNetworkError / DistStoreError: a rendezvous timeout
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        raise RankFailed(f"rank {rank} of {size} could not join the torchrun world at {where} within "
                         f"timeout_s {timeout_s:g} ({shorten(e)}); if this "
                         f"is not a torchrun job, `unset {' '.join(TORCHRUN_VARS)}`") from None


def run_ranks(fn: Callable, world: int, *args, timeout_s: float = 300.0, stop_grace_s: float = GRACE_S,
              device: str = "cpu", transport: str = "direct", writes_to: str | Path | None = None):
    """`stop_grace_s`: after a SIGTERM/SIGINT/SIGHUP/SIGUSR1 to this process, how long the ranks may take
    to finish (a trainer saves a checkpoint) before they are ended; a rank that returns normally
    then still counts, so a stopped trainer's summary comes back. `device`: 'cpu' or 'cuda'
    (resolved, `parallel.device.resolve_device`); `transport`: 'direct' (NCCL on GPUs) or 'host' (a
    gloo world, so ranks may share a GPU; elastic/runtime/transport.py). `writes_to`: the run
    folder the ranks write to: a rank that fails while its file system is full ends the job as
    `DiskFull` naming it."""
    if under_torchrun():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        rank_signals()
        here = _join_torchrun(rank, size, timeout_s, device, transport)
        try:
            out = fn(_make_context(timeout_s, here), *args)
        except Exception as e:
            failure = failure_of(e, rank, writes_to)
            if failure.disk_full is not None:
                raise failure.disk_full from None
            # As under the spawning launcher: an expected failure (a lost peer, a user error the
            # runtime wrapped) is one line naming rank, stage and phase; a bug keeps its traceback.
            user = user_error(e)
            if user is e:
                raise
            if user is not None or isinstance(e, ElasticFault):
                raise RankFailed(f"rank {rank} failed: {user or e}") from None
            raise
        finally:
            leave_world()
        return out if rank == 0 else None
    ctx = rank_context(getattr(fn, "__module__", None))
    queue = ctx.Queue()
    port = _free_port()
    job = RankJob(fn, args, world, port, timeout_s, os.getpid(), dict(os.environ), device, transport, writes_to)
    procs = [ctx.Process(target=_worker, args=(job, r, queue), daemon=False) for r in range(world)]
    with Supervisor(procs, stop_grace_s) as sup:
        for p in procs:
            p.start()
        result, errors, reported = _collect(procs, queue, sup)
        # Finished ranks exit by themselves; anything else (a failure, a signal) ends them now.
        sup.end(timeout_s if len(reported) == world and not errors else 2.0)
    full = [f.disk_full for f in errors if f.disk_full is not None]
    if full:  # whatever else failed (a peer's collective, a stop's save), it followed from this
        raise full[0]
    if sup.signum is not None:
        # A rank the forwarded signal ended before it could install its handlers (still starting
        # up) is the stop itself, not a failure to report as "rank 0 died (exit code -15)".
        forwarded = {-signal.SIGTERM, -sup.signum}
        errors = [f for f in errors if not (f.kind == "died" and int(f.message.split()[-1]) in forwarded)]
        if isinstance(result, dict) and isinstance(result.get("stopped"), dict):
            # Ranks see SIGINT as the SIGTERM it was forwarded as; the user pressed Ctrl+C.
            result["stopped"]["signal"] = signal.Signals(sup.signum).name
    if errors or len(reported) < world:  # (a rank killed after its report leaves the result whole)
        text = describe(errors) if errors else ("the ranks stopped before they finished"
                                                 if sup.signum is not None else "the ranks did not finish")
        if sup.killed:
            text += f"; rank(s) {', '.join(map(str, sup.killed))} did not end and were killed"
        if sup.signum is not None:
            raise Interrupted(sup.signum, f": {text}")
        raise RankFailed(text)
    return result


def _collect(procs, queue, sup: Supervisor) -> tuple[object, list[RankFailure], set[int]]:
    """Read the ranks' reports until all are in, a failure has had 5 s to gather context, or a
    signal's stop grace is over. Returns (rank 0's result, failures, ranks that reported)."""
    world = len(procs)
    result, errors, reported = None, [], set()
    first_error_at = None
    while len(reported) < world and not sup.stopping_overdue():
        # After the first failure, wait a moment for the others' reports: a survivor's error
        # usually says which stage and phase the run was in when a rank was lost.
        if first_error_at is not None and time.monotonic() - first_error_at > 5.0:
            break
        try:
            report = queue.get(timeout=0.5)
        except Exception:
            for r, p in enumerate(procs):
                if not p.is_alive() and r not in reported and p.exitcode not in (0, None):
                    reported.add(r)
                    errors.append(RankFailure(r, "died", f"exit code {p.exitcode}"))
                    first_error_at = first_error_at or time.monotonic()
            continue
        reported.add(report.rank)
        if isinstance(report, RankDone):
            result = report.result if report.rank == 0 else result
        else:
            errors.append(report)
            first_error_at = first_error_at or time.monotonic()
    return result, errors, reported
