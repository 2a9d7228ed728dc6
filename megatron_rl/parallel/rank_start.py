"""How the launcher starts its local ranks: forked from one fork server that imported torch once.

A spawned rank is a fresh interpreter that imports torch and the rank's code before it does
anything: about 3-4 CPU-seconds each, paid again by every rank of every run (on a 2-core machine a
4-rank start-up costs more than a small rollout). multiprocessing's `forkserver` pays it once: a
server process, started on the first launch, imports torch, torch.distributed and the rank
function's module, and every rank is a `fork()` of it. The server imports only: it runs no torch op
and no CUDA call, so it holds no thread pool, no communicator and no CUDA context to fork (PyTorch
supports forkserver for CUDA; plain `fork` of a launcher that has run torch ops is not safe).

What a fork keeps from the server, not from the launcher of the moment, and how each is handled:
  - sys.path, cwd, argv: multiprocessing sends the launcher's with every rank (as spawn does);
  - the environment: `worker_environment()` applies the launcher's, sent with the rank, before
    the rank reads any of it; variables read when an interpreter or its native libraries start
    (`START_ENV_PREFIXES`: PYTHONPATH and sitecustomize, OMP/MKL thread counts read at libgomp's
    load, LD_PRELOAD) cannot be applied late, so a launcher whose values differ from the server's
    spawns its ranks instead;
  - stdin/stdout/stderr: the server's, which are the launcher's (one launcher per CLI run);
  - signals: the server ignores the stop signals, so a SIGTERM to the whole process group (Slurm's
    pre-emption, a terminal closing) reaches the ranks and their graceful stop instead of killing
    the server, whose death would SIGKILL the ranks through their PR_SET_PDEATHSIG. It ends when
    its launcher does (multiprocessing closes its pipe), and so do the ranks.
"""
from __future__ import annotations

import multiprocessing.forkserver as forkserver
import multiprocessing.process as mp_process
import multiprocessing.util as mp_util
import os
import shutil
import signal
import sys
import tempfile
import threading

import torch.multiprocessing as mp

from megatron_rl.parallel.signals import LAUNCHER_SIGNALS

START_ENV_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_")
_server_env: dict | None = None  # the start-time variables the fork server started with


def _start_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith(START_ENV_PREFIXES)}


def rank_context(rank_module: str | None):
    """The multiprocessing context to start this launch's ranks with: the fork server (started
    now on the first launch, preloading torch and `rank_module`), or spawn where this process's
    start-time environment is no longer the server's."""
    global _server_env
    if _server_env is None:
        mp.get_context("forkserver").set_forkserver_preload(
            ["torch", "torch.distributed", *([rank_module] if rank_module else [])])
        _server_env = _start_env()
    elif _start_env() != _server_env:
        return mp.get_context("spawn")
    # Every launch: multiprocessing restarts a server that died (killed by hand, say), and the new
    # one must ignore the stop signals too.
    main = threading.current_thread() is threading.main_thread()  # signal.signal's only thread
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in LAUNCHER_SIGNALS} if main else {}
    short_socket_folder()
    try:  # the server inherits the ignored dispositions across its exec
        forkserver.ensure_running()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    return mp.get_context("forkserver")


def short_socket_folder() -> None:
    """multiprocessing's temporary folder, where the fork server's AF_UNIX socket lives, in a short
    private folder (mode 0700) under /tmp whatever TMPDIR is: a socket's path has at most 107
    bytes, and a cluster's per-job TMPDIR is often longer. Removed at exit, as multiprocessing's own."""
    config = mp_process.current_process()._config
    if config.get("tempdir") is not None:  # made already (this or an earlier launch)
        return
    for base in ("/tmp", "/dev/shm"):
        try:
            folder = tempfile.mkdtemp(prefix="ff-mp-", dir=base)
        except OSError:
            continue
        mp_util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
        config["tempdir"] = folder
        return  # neither writable: multiprocessing's default under TMPDIR


def worker_environment(env: dict) -> None:
    """In a rank, first: the launcher's environment (`dict(os.environ)`, sent with the rank),
    whichever process the rank was forked from; and a stderr that writes each line whole. Python's
    stderr writes through, so `print` sends a line and its newline in two writes, and ranks that
    share the launcher's stderr interleaved them ("[reward] a[reward] b", then an empty line)."""
    os.environ.clear()
    os.environ.update(env)
    sys.stderr.reconfigure(write_through=False, line_buffering=True)
