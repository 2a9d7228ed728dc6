"""Start a multi-rank job: spawn W ranks on this machine, or join a torchrun/Slurm world.

`run_ranks(fn, world, *args)` calls `fn(ctx, *args)` on every rank and returns rank 0's return
value. Started under torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set), the current process
is one rank of that world and non-zero ranks return None. Otherwise W processes are started (forked
from a fork server that imported torch once, parallel/rank_start.py); a rank
that raises or dies ends the whole job with an error naming the rank, after at most `timeout_s`.
`device` ('cpu' or 'cuda', see parallel/device.py) picks the world's backend: gloo or NCCL.
"""
from __future__ import annotations

import gc
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from elastic.errors import InputError, shorten
from elastic.runtime.groups import forget as forget_groups
from megatron_rl.errors import FlexFloorError, Interrupted
from megatron_rl.parallel.device import dist_backend, nccl_environment, rank_device
from megatron_rl.parallel.rank_start import rank_context, worker_environment
from megatron_rl.parallel.signals import GRACE_S, Supervisor, default_signals, rank_signals


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


def user_error(e: BaseException) -> InputError | None:
    """The user's mistake behind `e`, if any: the runtime wraps what a rank raises (`ElasticFault`
    names rank, stage and phase), so an `InputError` may sit in the cause chain."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, InputError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _worker(rank, world, port, timeout_s, fn, args, queue, launcher_pid, env, device="cpu", transport="direct"):
    worker_environment(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank_signals(launcher_pid)
    try:
        here = _init(rank, world, timeout_s, device, transport)
        out = fn(_make_context(timeout_s, here), *args)
        queue.put((rank, "ok", out if rank == 0 else None))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        from elastic.runtime.runtime import ElasticFault

        # Expected failures travel as their one-line message (a user error as itself, even when
        # the runtime wrapped it); bugs keep their traceback.
        user = user_error(e)
        if user is not None:
            queue.put((rank, "error", (type(user).__name__, str(user))))
        elif isinstance(e, (ElasticFault, Interrupted)) or getattr(e, "one_line", False):
            queue.put((rank, "error", (type(e).__name__, str(e))))
        else:
            queue.put((rank, "error", (type(e).__name__, traceback.format_exc())))
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


def _describe(errors: list[tuple[int, str, str]]) -> str:
    """One message: the root cause first (a death, else the first error), then the best context."""
    deaths = [e for e in errors if e[1] == "died"]
    first = deaths[0] if deaths else errors[0]
    rank, kind, msg = first
    text = f"rank {rank} died ({msg})" if kind == "died" else f"rank {rank} failed: {msg.strip()}"
    context = [e for e in errors if e is not first and e[1] != "died"]
    # Ranks that hit the same error (a shared checkpoint file, a config every rank reads) are
    # named, not repeated: the message stays one short line.
    alike = [e[0] for e in context if e[2].strip() == msg.strip()]
    if alike:
        text += f" (rank{'s' if len(alike) > 1 else ''} {', '.join(map(str, alike))} alike)"
    context = [e for e in context if e[0] not in alike]
    if context:
        text += f"; rank {context[0][0]} reported: {context[0][2].strip().splitlines()[-1]}"
    return text


# What torchrun (and Slurm scripts that start ranks themselves) set for every rank.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def driver_process() -> bool:
    """True in the process that speaks for the run: the launcher of flexfloor's own ranks, or
    torchrun's world rank 0 (every torchrun rank runs the driver's code; one of them says it)."""
    return os.environ.get("RANK", "0") == "0"


def under_torchrun() -> bool:
    """True when this process is one rank of a torchrun world. Some of its variables without the
    others (left over in a shell, half exported by a script) would join a world nobody else joins,
    and wait out the timeout: refused at once, saying what is missing."""
    have = [v for v in TORCHRUN_VARS if os.environ.get(v)]
    if not have:
        return False
    missing = [v for v in TORCHRUN_VARS if v not in have]
    unset = "unset " + " ".join(have)
    if missing:
        raise FlexFloorError(f"torchrun environment half set: {', '.join(have)} set but {', '.join(missing)} "
                             f"not; under torchrun all of {', '.join(TORCHRUN_VARS)} are set, outside it "
                             f"none is (`{unset}`)")
    try:
        rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        port = int(os.environ["MASTER_PORT"])
    except ValueError:
        got = ", ".join(f"{v}={shorten(repr(os.environ[v]), 20)}" for v in TORCHRUN_VARS)
        raise FlexFloorError(f"torchrun environment: expected integers in RANK, WORLD_SIZE, LOCAL_RANK and "
                             f"MASTER_PORT, got {got}") from None
    if not (0 <= rank < world and 0 <= local <= rank and 0 < port < 65536):
        raise FlexFloorError(f"torchrun environment: expected 0 <= LOCAL_RANK <= RANK < WORLD_SIZE and a "
                             f"port, got RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local} MASTER_PORT={port}")
    return True


def _join_torchrun(rank: int, size: int, timeout_s: float, device: str, transport: str) -> torch.device:
    try:
        return _init(rank, size, timeout_s, device, transport)
    except (RuntimeError, ValueError) as e:  # torch's DistNetworkError / DistStoreError: a rendezvous timeout
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        raise RankFailed(f"rank {rank} of {size} could not join the torchrun world at {where} within "
                         f"timeout_s {timeout_s:g} ({shorten(e)}); if this "
                         f"is not a torchrun job, `unset {' '.join(TORCHRUN_VARS)}`") from None


def run_ranks(fn: Callable, world: int, *args, timeout_s: float = 300.0, stop_grace_s: float = GRACE_S,
              device: str = "cpu", transport: str = "direct"):
    """`stop_grace_s`: after a SIGTERM/SIGINT/SIGHUP/SIGUSR1 to this process, how long the ranks may take
    to finish (a trainer saves a checkpoint) before they are ended; a rank that returns normally
    then still counts, so a stopped trainer's summary comes back. `device`: 'cpu' or 'cuda'
    (resolved, `parallel.device.resolve_device`); `transport`: 'direct' (NCCL on GPUs) or 'host' (a
    gloo world, so ranks may share a GPU; elastic/runtime/transport.py)."""
    if under_torchrun():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        rank_signals()
        here = _join_torchrun(rank, size, timeout_s, device, transport)
        try:
            out = fn(_make_context(timeout_s, here), *args)
        except Exception as e:
            from elastic.runtime.runtime import ElasticFault

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
    procs = [ctx.Process(target=_worker,
                         args=(r, world, port, timeout_s, fn, args, queue, os.getpid(), dict(os.environ), device,
                               transport),
                         daemon=False)
             for r in range(world)]
    with Supervisor(procs, stop_grace_s) as sup:
        for p in procs:
            p.start()
        result, errors, reported = _collect(procs, queue, sup)
        # Finished ranks exit by themselves; anything else (a failure, a signal) ends them now.
        sup.end(timeout_s if len(reported) == world and not errors else 2.0)
    if sup.signum is not None:
        # A rank the forwarded signal ended before it could install its handlers (still starting
        # up) is the stop itself, not a failure to report as "rank 0 died (exit code -15)".
        forwarded = {-signal.SIGTERM, -sup.signum}
        errors = [e for e in errors if not (e[1] == "died" and int(e[2].split()[-1]) in forwarded)]
        if isinstance(result, dict) and isinstance(result.get("stopped"), dict):
            # Ranks see SIGINT as the SIGTERM it was forwarded as; the user pressed Ctrl+C.
            result["stopped"]["signal"] = signal.Signals(sup.signum).name
    if errors or len(reported) < world:  # (a rank killed after its report leaves the result whole)
        text = _describe(errors) if errors else ("the ranks stopped before they finished"
                                                 if sup.signum is not None else "the ranks did not finish")
        if sup.killed:
            text += f"; rank(s) {', '.join(map(str, sup.killed))} did not end and were killed"
        if sup.signum is not None:
            raise Interrupted(sup.signum, f": {text}")
        raise RankFailed(text)
    return result


def _collect(procs, queue, sup: Supervisor):
    """Read the ranks' reports until all are in, a failure has had 5 s to gather context, or a
    signal's stop grace is over. Returns (rank 0's result, errors, ranks that reported)."""
    world = len(procs)
    result, errors, reported = None, [], set()
    first_error_at = None
    while len(reported) < world and not sup.stopping_overdue():
        # After the first failure, wait a moment for the others' reports: a survivor's error
        # usually says which stage and phase the run was in when a rank was lost.
        if first_error_at is not None and time.monotonic() - first_error_at > 5.0:
            break
        try:
            rank, status, payload = queue.get(timeout=0.5)
        except Exception:
            for r, p in enumerate(procs):
                if not p.is_alive() and r not in reported and p.exitcode not in (0, None):
                    reported.add(r)
                    errors.append((r, "died", f"exit code {p.exitcode}"))
                    first_error_at = first_error_at or time.monotonic()
            continue
        reported.add(rank)
        if status == "ok":
            result = payload if rank == 0 else result
        else:
            errors.append((rank, *payload))
            first_error_at = first_error_at or time.monotonic()
    return result, errors, reported
