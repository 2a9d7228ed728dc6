"""Signals and stuck ranks: a job the launcher started ends whole, and keeps what it finished.

Three pieces, one per side of the launcher:
  - `rank_signals()` (every rank): SIGTERM, SIGHUP and SIGUSR1 raise `Interrupted` in the rank, so its
    `finally` blocks flush what is finished. A spawned rank ignores SIGINT, because its launcher
    turns a Ctrl+C into one SIGTERM for every rank; under torchrun, which forwards the SIGINT
    itself, SIGINT counts as a stop signal too. A spawned rank also dies with its launcher
    (PR_SET_PDEATHSIG on its parent, the launcher or its fork server, which ends with it), so a
    SIGKILLed launcher leaves no orphan computing into `--out`.
  - `StopOnSignal` (the trainer's loop): Megatron's DistributedSignalHandler. The handler only sets a
    flag; after every step all ranks all-reduce it, so all of them save the same step and leave together.
  - `Supervisor` (the spawning launcher): forwards SIGTERM/SIGINT/SIGHUP/SIGUSR1 to its ranks, gives them
    `stop_grace_s` to finish, and ends any rank that outlives that (or a failure) with SIGTERM, then
    SIGKILL after `GRACE_S`. SIGKILL is the only signal a frozen (SIGSTOPped) process obeys.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from megatron_rl.errors import Interrupted

GRACE_S = 10.0  # how long a rank may take to end after SIGTERM before it is SIGKILLed
# What stops this rank (see rank_signals). SIGHUP: the terminal closed or the SSH session dropped,
# which must save and stop like a pre-emption, not kill the run mid-step (its default).
_stop_signals = [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1]
LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1


def _raise_interrupted(signum, _frame):
    raise Interrupted(signum)


def rank_signals(launcher_pid: int | None = None) -> None:
    """Install a rank's default handlers (see the module doc); `launcher_pid`: die with it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if launcher_pid is None and signal.SIGINT not in _stop_signals:
        _stop_signals.append(signal.SIGINT)
    for sig in _stop_signals:
        signal.signal(sig, _raise_interrupted)
    if launcher_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # The parent is the launcher's fork server (parallel/rank_start.py), which ends with the
        # launcher, or the launcher itself (spawned ranks). Not Linux: the Supervisor still ends the
        # ranks it can see.
        if not die_with_parent(os.getppid()) or not pid_alive(launcher_pid):
            os._exit(1)


def die_with_parent(parent: int) -> bool:
    """Ask the kernel to SIGKILL this process when the thread that started it ends
    (PR_SET_PDEATHSIG; Linux only); False when `parent`, the process expected to have started it,
    is already gone: it died before the prctl took effect, so no signal will come."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass
    return os.getppid() == parent


def pid_alive(pid: int) -> bool:
    """Process `pid` exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def default_signals() -> None:
    """After a rank has reported: a SIGTERM now just ends it (no handler running in interpreter
    shutdown, where an exception only leaves it hanging)."""
    if threading.current_thread() is threading.main_thread():
        for sig in _stop_signals:
            signal.signal(sig, signal.SIG_DFL)


class StopOnSignal:
    """`with StopOnSignal(device) as stop:` ... `if stop.requested(): save; break` once per step.

    Collective: every rank must call `requested()` the same number of times.
    """

    def __init__(self, device=None):
        self.device = device
        self.signum: int | None = None
        self.deadline = False
        self._old: dict = {}

    def _flag(self, signum, _frame):
        self.signum = signum

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._flag) for s in _stop_signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)

    def requested(self, deadline: bool = False) -> bool:
        """True on every rank when any rank got a stop signal, or (`deadline`) judged that the next
        step no longer fits before the job's end (one small all-reduce); `self.deadline` then says
        it was the deadline on some rank."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if self.signum is None else self.signum, int(deadline)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum, self.deadline = int(flag[0].item()), bool(flag[1].item())
        if signum and self.signum is None:
            self.signum = signum
        return bool(signum) or self.deadline


class Supervisor:
    """The spawning launcher's side: `with Supervisor(procs, stop_grace_s) as sup:` while waiting.

    A first SIGTERM, SIGINT, SIGHUP or SIGUSR1 is forwarded (SIGINT as SIGTERM) and starts the stop grace;
    a second one, or the end of the grace, ends the ranks at once. `end()` leaves no rank alive.
    """

    def __init__(self, procs: list, stop_grace_s: float):
        self.procs, self.stop_grace_s = procs, stop_grace_s
        self.signum: int | None = None
        self.deadline: float | None = None
        self.killed: list[int] = []  # ranks that had to be SIGKILLed
        self._old: dict = {}

    def __enter__(self) -> Supervisor:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on_signal) for s in LAUNCHER_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.end(0.0)  # no-op after a normal `end()`; after an exception, no rank outlives us
        finally:
            for s, old in self._old.items():
                signal.signal(s, old)

    def _on_signal(self, signum, _frame) -> None:
        if self.signum is not None:  # the second signal: no more patience
            self.deadline = time.monotonic()
            return
        self.signum = signum
        self.deadline = time.monotonic() + self.stop_grace_s
        self._send(signal.SIGTERM if signum == signal.SIGINT else signum)

    def _send(self, sig: int) -> None:
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def stopping_overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def end(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the ranks to exit, SIGTERM the rest, then SIGKILL after GRACE_S."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in self.procs):
            self._send(signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for r, p in enumerate(self.procs):
            if p.is_alive():
                self.killed.append(r)
                p.kill()
                p.join(timeout=5)
