"""The pipe protocol between a run and its user-code workers: length-prefixed frames.

The run sends pickles (its own data: the worker may unpickle them) and the worker answers in JSON,
which the run parses without running anything of the worker's. The run's side of each pipe is
read and written against a deadline, so a worker that stops answering costs at most its bound.
"""
from __future__ import annotations

import os
import select
import struct
import time

HEADER = struct.Struct(">I")


class Closed(Exception):
    """The other end closed its pipe (its process ended)."""


class Late(Exception):
    """The deadline passed before the frame was through."""


def send(fd: int, data: bytes, deadline: float | None = None) -> None:
    """One frame to `fd`; `deadline` (time.monotonic()): raise `Late` instead of blocking past it."""
    view = memoryview(HEADER.pack(len(data)) + data)
    # Against a deadline, at most PIPE_BUF bytes a write: what select's "writable" guarantees fits,
    # so no write blocks on a worker that has stopped reading.
    step = select.PIPE_BUF if deadline is not None else len(view)
    while view:
        _wait(fd, deadline, write=True)
        try:
            view = view[os.write(fd, view[:step]):]
        except BrokenPipeError:
            raise Closed from None


def receive(fd: int, deadline: float | None = None, limit: int = 1 << 30) -> bytes:
    """One frame from `fd`; `Closed` at end of file, `Late` past `deadline`, ValueError for a frame
    longer than `limit` bytes."""
    (size,) = HEADER.unpack(_read(fd, HEADER.size, deadline))
    if size > limit:
        raise ValueError(f"a frame of {size} bytes, above the limit of {limit}")
    return _read(fd, size, deadline)


def _read(fd: int, n: int, deadline: float | None) -> bytes:
    parts, left = [], n
    while left:
        _wait(fd, deadline, write=False)
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise Closed
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _wait(fd: int, deadline: float | None, write: bool) -> None:
    if deadline is None:
        return
    left = deadline - time.monotonic()
    ready = select.select([], [fd], [], max(left, 0))[1] if write else select.select([fd], [], [], max(left, 0))[0]
    if not ready:
        raise Late
