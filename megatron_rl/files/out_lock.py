"""One run per `--out` folder: `with hold_out_dir(path, "train"):` around everything a run writes there.

Two runs writing one folder clobber each other's checkpoints, metrics and config (both exit 0, the
folder holds a mix). The lock is an `flock` on `DIR/.flexfloor.lock`, held for the whole run by the
launching process (under torchrun, by global rank 0 alone): the kernel drops it when that process
ends in any way, SIGKILL included, so a dead holder's lock is reclaimed by the next run with nothing
to clean up. The file records the holder (PID, command, start time) for the refusal's one line.
flock is local to one host (and to NFS clients that support it). On a file system without flock
(Lustre or NFS mounted without locks) the lock falls back, saying so in one line, to an atomic lock
file `DIR/.flexfloor.lock.excl` created with O_EXCL and holding the PID and host; the run removes it
when it ends, and a later run on the same host that finds its PID dead takes it over (one left
by another host names that host, for a person to judge).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

from elastic.errors import shorten
from megatron_rl.errors import FlexFloorError
from megatron_rl.parallel.signals import pid_alive
from megatron_rl.parallel.torchrun import driver_process

LOCK_NAME = ".flexfloor.lock"
EXCL_NAME = ".flexfloor.lock.excl"
# What flock raises where the file system does not support it.
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class OutDirInUse(FlexFloorError):
    pass


def _holder(fh) -> str:
    try:
        fh.seek(0)
        info = json.loads(fh.read(4096) or "{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(info["started"])))
        return f"pid {int(info['pid'])} (`flexfloor {shorten(str(info['command']), 40)}`, started {started})"
    except (ValueError, KeyError, TypeError, OverflowError, OSError):
        return "another process (its lock file names no holder)"


def in_use_by(path: str | Path) -> str | None:
    """Who holds `path`'s lock now (one line), or None: probed without taking it for longer than
    the probe (a shared flock, released at once)."""
    lock = Path(path) / LOCK_NAME
    excl = _excl_holder(Path(path) / EXCL_NAME)
    if excl is not None and not excl.stale:
        return f"{excl.who} ({Path(path) / EXCL_NAME})"
    try:
        fh = open(lock, encoding="utf-8")
    except OSError:
        return None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fh)
        except OSError:
            return None
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


@contextlib.contextmanager
def hold_out_dir(path: str | Path | None, command: str, flag: str = "--out"):
    """Hold `path`'s lock while the body runs; a second holder is refused at once, in one line."""
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
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            print(f"[{command}] {flag} {path}: the file system has no flock ({e.strerror}); locking with "
                  f"{EXCL_NAME} (O_EXCL, PID and host) instead", file=sys.stderr, flush=True)
            with _excl_lock(Path(path), command, flag):
                yield
            return
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "command": command, "started": time.time()}))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class _ExclHolder(NamedTuple):
    pid: int | None
    host: str

    @property
    def who(self) -> str:
        return f"pid {self.pid} on {self.host}" if self.pid is not None else "a holder the file does not name"

    @property
    def stale(self) -> bool:
        """Its run is gone: a dead PID on this host (another host's PID cannot be probed from here)."""
        return self.host == socket.gethostname() and self.pid is not None and not pid_alive(self.pid)


def _excl_holder(lock: Path) -> _ExclHolder | None:
    """Who `lock` (an O_EXCL lock file) names; None when there is no such file."""
    try:
        text = lock.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError:
        return _ExclHolder(None, "?")
    try:
        info = json.loads(text or "{}")
        return _ExclHolder(int(info["pid"]), str(info["host"]))
    except (ValueError, KeyError, TypeError):
        return _ExclHolder(None, "?")


@contextlib.contextmanager
def _excl_lock(path: Path, command: str, flag: str):
    """The lock without flock: a file only one process can create; a dead holder's on this host is stale."""
    lock, host = path / EXCL_NAME, socket.gethostname()
    me = json.dumps({"pid": os.getpid(), "host": host, "command": command, "started": time.time()})
    for _attempt in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            holder = _excl_holder(lock) or _ExclHolder(None, "?")
            if holder.stale:
                lock.unlink(missing_ok=True)
                continue
            raise OutDirInUse(f"{flag} {path}: in use by {holder.who} ({lock}); wait for it to end, "
                              f"delete {lock} if that run is gone, or choose another {flag}") from None
    else:
        raise OutDirInUse(f"{flag} {path}: {lock} was taken again while its stale holder was removed")
    try:
        os.write(fd, me.encode())
        os.close(fd)
        yield
    finally:
        lock.unlink(missing_ok=True)

