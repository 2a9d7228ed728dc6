"""A full disk, whichever writer meets it first: one line, "no space left on device: PATH", exit 1.

A run's writers (the rollout's response stream, the checkpoint save, sync or async, the metrics,
W&B) each report a full disk their own way: an OSError with errno ENOSPC from Python's files, often
without a file name (a buffered write fails at its flush); torch's zip writer's "unexpected pos 704
vs 598" (a short write), whose OSError DCP drops when it gathers a rank's failure to the others by
pickling it; safetensors' own error type. So the rule is one, applied where a rank's failure is
reported (parallel/rank_failures.py) and where the CLI ends a command: a failure is a full disk
when an OSError of `FULL` is anywhere in its chain, or when the folder the run writes to has no room
left as it fails. The CLI prints the line and exits 1 (not 2: the inputs were fine). Nothing is
removed, so the last checkpoint whose save completed is still `latest` and a rerun resumes there.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

# What each errno says; a quota is a full disk for the user who hits it.
FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# Free space below this when a writer failed: the file system is full. A failed write fills the
# disk to its last block before the error (the kernel writes what fits), and no file of a run is
# smaller than a block, so a full disk shows a few KiB at most.
NO_ROOM_BYTES = 1 << 20


class DiskFull(OSError):
    """A writer found no room: `errno` one of FULL, `filename` the file or the run's folder."""

    def __str__(self) -> str:
        said = FULL.get(self.errno, self.strerror or "no space left on device")
        return f"{said}: {self.filename}" if self.filename else said


def disk_full(e: BaseException, writes_to: str | Path | None = None) -> DiskFull | None:
    """The full disk behind failure `e`, if it is one; `writes_to`: the folder the failed code
    writes to, named when the OS error names no file, and asked for its free space when the
    error itself was lost on the way."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in FULL:
            return DiskFull(x.errno, os.strerror(x.errno), x.filename or (str(writes_to) if writes_to else None))
    if writes_to is not None and no_room(writes_to):
        return DiskFull(errno.ENOSPC, os.strerror(errno.ENOSPC), str(writes_to))
    return None


def no_room(path: str | Path) -> bool:
    """True when the file system holding `path` has (almost) no space left for this user."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    free = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may write into the reserved blocks
    return free * st.f_frsize < NO_ROOM_BYTES


def _chain(e: BaseException):
    """`e`, what caused it or was being handled when it was raised, and so on; and the failures a
    DCP CheckpointException gathered from the ranks ({rank: exception or (exception, stack)})."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
