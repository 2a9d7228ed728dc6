"""Output paths are checked before any rank starts: a run must not compute for an hour and then
fail to write its report (a file where a folder was meant, a read-only or missing folder)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

from elastic.errors import shorten
from megatron_rl.errors import FlexFloorError
from megatron_rl.files.owned_paths import NAME_MAX, refuse_held_run, refuse_symlinks_out
from megatron_rl.metrics.logger import require_matplotlib


def _check_path(p: Path, label: str) -> None:
    """What the OS would refuse only when the run writes: a name over NAME_MAX bytes, a path too
    long, a symlink loop (or any other error but "does not exist yet")."""
    for part in p.parts:
        n = len(os.fsencode(part))
        if n > NAME_MAX:
            raise FlexFloorError(f"{label}: the name {shorten(part, 24)} is {n} bytes, over the file system's "
                                 f"limit of {NAME_MAX}")
    try:
        os.stat(p)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            what = "a symlink loop" if e.errno == errno.ELOOP else "unusable"
            raise FlexFloorError(f"{label}: {what} ({e.strerror})") from None


def _probe(folder: Path, label: str) -> None:
    probe = folder / f".flexfloor-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise FlexFloorError(f"{label}: cannot write in {folder} ({e.strerror})") from None


def check_out_dir(path: str | Path | None, flag: str) -> None:
    """`path` is (or can become) a folder this process can write in; creates it."""
    if path is None:
        return
    p, label = Path(path), f"{flag} {path}"
    _check_path(p, label)
    if p.exists() and not p.is_dir():
        raise FlexFloorError(f"{label}: exists and is not a folder")
    refuse_held_run(p, flag)
    if p.is_dir():
        refuse_symlinks_out(p, p, flag=flag)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlexFloorError(f"{label}: cannot create the folder ({e.strerror})") from None
    _probe(p, label)


def check_out_file(path: str | Path | None, flag: str) -> None:
    """`path` can be written: its folder exists and takes files, and it is not itself a folder."""
    if path is None:
        return
    p, label = Path(path), f"{flag} {path}"
    _check_path(p, label)
    if p.is_dir():
        raise FlexFloorError(f"{label}: is a folder, expected a file name")
    refuse_held_run(p, flag)
    if not p.parent.is_dir():
        raise FlexFloorError(f"{label}: folder {p.parent} does not exist")
    _probe(p.parent, label)


def check_plot_dir(path: str | Path | None, flag: str = "--plot") -> None:
    """`path` can take figures and matplotlib (optional: the `dev` and `plot` extras) imports."""
    if path is None:
        return
    require_matplotlib(flag)
    check_out_dir(path, flag)
