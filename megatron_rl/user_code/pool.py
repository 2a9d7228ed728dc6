"""Worker processes that run a contained user file (rewards; tools later), from the run's side.

A `WorkerPool` starts `size` workers (`worker.py`) when it is made, each importing the file in the
background while the run builds its model. A call takes an idle worker, sends the arguments and
waits for the answer until `timeout_s`; a worker past it is killed (SIGKILL: a hang, a loop, a
leaked thread all end with it) and replaced at once, and its call is `timed_out`. A worker that
dies in a call (`os._exit`, a crash) is replaced too. Waiting for a worker's import is bounded
apart (`IMPORT_TIMEOUT_S`), and an import that fails is one line (`ConfigError`).

Workers are fresh interpreters (not forks of a rank that holds threads, a process group or CUDA),
started with the run's `sys.path`, working directory and environment, from one spawner thread that
lives as long as the pool: the workers' PR_SET_PDEATHSIG is tied to the thread that started them.

`shared_pool` is this process's pool for a file: the reward phase, the scoring leases and
validation each judge with their own `Scorer`, and all of them use the same workers (one per rank:
cheap on a 2-core CI machine).
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from megatron_rl.errors import ConfigError
from megatron_rl.user_code import frames
from megatron_rl.user_code.loader import UserFile

# How long a worker may take to start and import the file: an import of torch or of a task package
# takes seconds on a loaded 2-core machine; this bounds an import that never ends.
IMPORT_TIMEOUT_S = 60.0
MAX_REPLY = 1 << 20  # bytes of one answer (a score and its extras take a few hundred)
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
         "from megatron_rl.user_code.worker import main; main()")


@dataclass(frozen=True)
class CallResult:
    """One call: the kind's plain data of what it returned, or why there is none."""

    value: Any = None
    error: str | None = None  # raised, returned what its kind refuses, ended its worker, ran late
    timed_out: bool = False


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    requests: int  # the run's ends of the two pipes
    replies: int
    ready: bool = False
    broken: str | None = None  # why its import failed: every call says it again

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for fd in (self.requests, self.replies):
            os.close(fd)


class WorkerPool:
    def __init__(self, file: UserFile, timeout_s: float, size: int = 1):
        self.file, self.timeout_s = file, timeout_s
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix=f"{file.kind.section}-workers")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()  # guards _all (a replacement, a close)
        for _ in range(size):
            self._idle.put(self._spawn())

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_import(self) -> None:
        """Wait until every worker has imported the file; `ConfigError` (one line) if one could not."""
        workers = [self._idle.get() for _ in range(len(self._all))]
        try:
            for w in workers:
                self._await_ready(w)
        finally:
            for w in workers:
                self._idle.put(w)

    def call(self, *args) -> CallResult:
        """`fn(*args)` in an idle worker (waiting for one), within `timeout_s`."""
        worker = self._idle.get()
        try:
            self._await_ready(worker)
            deadline = time.monotonic() + self.timeout_s
            frames.send(worker.requests, pickle.dumps(args), deadline)
            reply = frames.receive(worker.replies, deadline, MAX_REPLY)
        except frames.Late:
            worker = self._replace(worker)
            return CallResult(error=f"no result within {self.file.kind.section}.timeout_s {self.timeout_s:g}s "
                                    "(its worker was ended and replaced)", timed_out=True)
        except frames.Closed:
            status = worker.proc.wait()
            worker = self._replace(worker)
            return CallResult(error=f"its worker process ended during the call (exit status {status}) "
                                    "and was replaced")
        except ValueError as e:  # a frame over MAX_REPLY: the stream is out of step from here on
            worker = self._replace(worker)
            return CallResult(error=f"its worker sent {e} (it was replaced)")
        finally:
            self._idle.put(worker)
        return _result(reply)

    def close(self) -> None:
        """End every worker (and the spawner thread); safe to call twice."""
        with self._lock:
            workers, self._all = self._all, []
        for w in workers:
            w.end()
        self._spawner.shutdown()

    def _spawn(self) -> _Worker:
        worker = self._spawner.submit(self._start).result()
        with self._lock:
            self._all.append(worker)
        return worker

    def _start(self) -> _Worker:
        """(In the spawner thread.) A fresh worker, its import begun."""
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(req_r), str(rep_w), str(os.getpid())],
            pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL,
            stdout=2)  # what user code prints joins the rank's log, never the CLI's stdout (a JSON summary)
        os.close(req_r)
        os.close(rep_w)
        start = {"kind": self.file.kind.section, "path": self.file.path, "name": self.file.name}
        frames.send(req_w, pickle.dumps(start))  # a few hundred bytes: the pipe holds them
        return _Worker(proc, req_w, rep_r)

    def _replace(self, worker: _Worker) -> _Worker:
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        worker.end()
        return self._spawn()

    def _await_ready(self, worker: _Worker) -> None:
        if worker.ready:
            return
        if worker.broken is None:
            worker.broken = self._import_failure(worker)
            worker.ready = worker.broken is None
        if worker.broken is not None:
            raise ConfigError(worker.broken)

    def _import_failure(self, worker: _Worker) -> str | None:
        where = f"{self.file.kind.section}.path {self.file.path}"
        try:
            answer = json.loads(frames.receive(worker.replies, time.monotonic() + IMPORT_TIMEOUT_S, MAX_REPLY))
        except frames.Late:
            worker.proc.kill()
            return f"{where}: importing it did not finish within {IMPORT_TIMEOUT_S:g} s"
        except (frames.Closed, ValueError):
            return f"{where}: importing it ended its worker process (exit status {worker.proc.wait()})"
        return None if answer == {"ready": True} else str(answer.get("error", answer))[:2000]


def _result(reply: bytes) -> CallResult:
    """A worker's answer, checked for its shape: the worker runs user code, which may write anything."""
    try:
        answer = json.loads(reply)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return CallResult(error=answer["error"][:2000])
    if isinstance(answer, dict) and "value" in answer:
        return CallResult(value=answer["value"])
    return CallResult(error="its worker sent an answer that is not one")


_SHARED: dict[tuple[UserFile, float], WorkerPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(file: UserFile, timeout_s: float) -> WorkerPool:
    """This process's pool for `file` (made at the first ask, one worker)."""
    with _SHARED_LOCK:
        if (file, timeout_s) not in _SHARED:
            _SHARED[file, timeout_s] = WorkerPool(file, timeout_s)
        return _SHARED[file, timeout_s]


@atexit.register
def close_shared_pools() -> None:
    """End this process's shared workers (at exit; tests between cases). A rank that ends without
    exit handlers (`os._exit`) closes their pipes, and their PR_SET_PDEATHSIG ends any left."""
    with _SHARED_LOCK:
        pools = list(_SHARED.values())
        _SHARED.clear()
    for pool in pools:
        pool.close()
