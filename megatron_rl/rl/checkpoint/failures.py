"""A checkpoint save or load that failed underneath (the file system, DCP, a torn shard), said in
one line: the file and the OS's reason ('No space left on device' on a full disk) rather than DCP's
wrapped traceback, and, for a save, that the previous checkpoint stays in force.
"""
from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException


def save_failure(path: Path, e: BaseException) -> str:
    return f"{path}: cannot write the checkpoint ({failure_cause(e)}); the previous checkpoint stays in force"


def failure_cause(e: BaseException) -> str:
    """One line for a loader/writer failure: the underlying OS error (file and reason: 'No space left
    on device' on a full disk) when there is one, else the innermost exception's first line."""
    if isinstance(e, CheckpointException):
        for exc in (pair[0] if isinstance(pair, tuple) else pair for pair in e.failures.values()):
            e = exc
            break
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
        if e.__cause__ is None and e.__context__ is None:
            break
        e = e.__cause__ or e.__context__
    if isinstance(e, EOFError):
        return "a shard ends early (truncated file)"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"
