"""One run per `--out` folder: `with hold_out_dir(path, "train"):` around everything a run writes there.

Two runs writing one folder clobber each other's checkpoints, metrics and config (both exit 0, the
folder holds a mix). The lock is an `flock` on `DIR/.flexfloor.lock`, held for the whole run by the
launching process (under torchrun, by global rank 0 alone): the kernel drops it when that process
ends in any way, SIGKILL included, so a dead holder's lock is reclaimed by the next run with nothing
to clean up. The file records the holder (PID, command, start time) for the refusal's one line.
flock is local to one host (and to NFS clients that support it): two hosts sharing a folder over a
file system without flock are not protected.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

from megatron_rl.errors import FlexFloorError

LOCK_NAME = ".flexfloor.lock"


class OutDirInUse(FlexFloorError):
    pass


def _holder(fh) -> str:
    try:
        fh.seek(0)
        info = json.loads(fh.read(4096) or "{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(info["started"])))
        return f"pid {int(info['pid'])} (`flexfloor {str(info['command'])[:40]}`, started {started})"
    except (ValueError, KeyError, TypeError, OverflowError, OSError):
        return "another process (its lock file names no holder)"


@contextlib.contextmanager
def hold_out_dir(path: str | Path | None, command: str, flag: str = "--out"):
    """Hold `path`'s lock while the body runs; a second holder is refused at once, in one line."""
    from megatron_rl.parallel.launch import driver_process

    if path is None or not driver_process():  # torchrun: the world's rank 0 holds it
        yield
        return
    lock = Path(path) / LOCK_NAME
    try:
        fh = open(lock, "a+", encoding="utf-8")
    except OSError as e:
        raise FlexFloorError(f"{flag} {path}: cannot create {LOCK_NAME} ({e.strerror})") from None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutDirInUse(f"{flag} {path}: in use by {_holder(fh)}; wait for it to end, or "
                              f"choose another {flag}") from None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "command": command, "started": time.time()}))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
