"""What FlexFloor may delete or overwrite: only what it created, or what it can recognise as its own.

Every writer that replaces or removes a path asks this module first:
  - an HF export (`flexfloor export --to`, the trainer's `DIR/hf`) carries `EXPORT_MARKER`; a
    non-empty folder without it is someone else's (a downloaded base model, a run folder, `.`) and is
    never replaced. The run's own `DIR/hf` is recognised by where it is: inside a run folder.
  - an export is written into a fresh temporary folder beside the target and swapped in; the
    temporary and the displaced folder have names made in this call, so a `<to>.tmp` or `<to>.old`
    the user has is never touched.
  - a checkpoint save never follows a symlink out of `DIR/checkpoints` (a planted
    `step_000002 -> elsewhere` would write the run's weights outside `--out`).
  - a small file that must never be half-written (`latest`, a truncated `metrics.jsonl`) is
    written beside itself and renamed onto itself.
  - a refused `train` removes the folders it created for the run and nothing else (`rmdir` only
    removes what is empty).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from elastic.errors import shorten
from megatron_rl.errors import CheckpointError, FlexFloorError
from megatron_rl.files.out_lock import LOCK_NAME, OutDirInUse, in_use_by
from megatron_rl.parallel.torchrun import driver_process

EXPORT_MARKER = ".flexfloor-export"
# A path component's longest name on Linux file systems (NAME_MAX): ext4, xfs, btrfs, tmpfs, NFS.
NAME_MAX = 255
# The longest name a folder or file we write may have: NAME_MAX less the ".<name>.tmp-XXXXXXXX" of the
# temporary folder an export is written into first.
NAME_BYTES = NAME_MAX - 16


def check_name_lengths(path: str | Path, flag: str) -> None:
    """One line for a path component the file system cannot hold (an OSError traceback otherwise)."""
    for part in Path(path).parts:
        if len(os.fsencode(part)) > NAME_BYTES:
            raise FlexFloorError(f"{flag} {shorten(str(path), 80)}: a path component is {len(os.fsencode(part))} "
                                 f"bytes long; at most {NAME_BYTES} fit")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def run_folder_of(path: Path) -> Path | None:
    """The nearest folder at or above `path` that is a `flexfloor train --out` (its lock file and
    checkpoints/ folder), or None."""
    for folder in (path, *path.parents):
        if (folder / LOCK_NAME).is_file() and (folder / "checkpoints").is_dir():
            return folder
    return None


def check_export_target(to: str | Path, out: str | Path | None, flag: str = "--to") -> Path | None:
    """`to` as an export of run folder `out` (None: of no run, `tools/sft_warmstart.py --out`) may
    write it, or one line naming `flag` and it. Returns the run folder whose lock the export must
    hold besides `out`'s (`to` inside another run), or None."""
    raw, flag = Path(to), f"{flag} {to}"
    check_name_lengths(raw, flag.split()[0])
    target = raw.resolve()
    run = Path(out).resolve() if out is not None else None
    example = Path(out) / "hf" if out is not None else Path(to).parent / "model"
    if raw.name in ("", ".", "..") or target == target.parent:
        raise FlexFloorError(f"{flag}: not a folder an export can be written to; name a new folder, "
                             f"e.g. {example}")
    if run is not None and _inside(run, target):
        raise FlexFloorError(f"{flag}: is --out {out} or a folder holding it; the export would replace "
                             f"the run; name a new folder, e.g. {example}")
    own = run / "hf" if run is not None else None
    if run is not None and _inside(target, run) and target != own:
        raise FlexFloorError(f"{flag}: is inside --out {out}, where only {example} is an export")
    other = run_folder_of(target.parent)
    if other is not None and other != run and target != other / "hf":
        raise FlexFloorError(f"{flag}: is inside the run folder {other}, where only {other / 'hf'} is an export")
    if raw.is_symlink():
        raise FlexFloorError(f"{flag}: is a symlink; name the folder itself")
    if raw.exists() and not raw.is_dir():
        raise FlexFloorError(f"{flag}: is an existing file; an export is a folder")
    if raw.is_dir() and target != own and (other is None or target != other / "hf") \
            and any(raw.iterdir()) and not (raw / EXPORT_MARKER).is_file():
        raise FlexFloorError(f"{flag}: is a non-empty folder that is not a FlexFloor export (it has no "
                             f"{EXPORT_MARKER}); it is left as it is: name a new or empty folder")
    return other if other is not None and other != run else None


class FolderSwap:
    """A folder written beside `path` under a name made here (`.tmp`), then swapped onto `path`
    (`commit`): `path` is either what it was or the whole new folder; `abort` removes only `.tmp`."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))

    def commit(self) -> None:
        (self.tmp / EXPORT_MARKER).write_text("written by flexfloor; a later export may replace this folder\n")
        old = None
        try:
            if self.path.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.old-", dir=self.path.parent))
                os.replace(self.path, old)  # onto the empty folder just made
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            if old is not None and not self.path.exists():
                os.replace(old, self.path)
            elif old is not None:
                old.rmdir()
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def replace_folder(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a `FolderSwap` of `path`, then swapped in; raises what `write` raised,
    with `path` as it was."""
    swap = FolderSwap(path)
    try:
        write(swap.tmp)
    except BaseException:
        swap.abort()
        raise
    swap.commit()


def refuse_symlinks_out(root: Path, *paths: Path, flag: str | None = None) -> None:
    """A writer writes only inside `root` (`DIR/checkpoints`, a `--out` or `--plot` folder): any of
    `paths`, or a file directly in one of them, that is a symlink resolving outside `root` is
    refused, naming it (and `flag`, for a folder the user named)."""
    base = root.resolve()
    for p in paths:
        for q in (p, *sorted(p.iterdir() if p.is_dir() and not p.is_symlink() else ())):
            if q.is_symlink() and not _inside(q.resolve(), base):
                where = f"{flag} {root}: {q.name}" if flag else str(q)
                error = FlexFloorError if flag else CheckpointError
                raise error(f"{where}: a symlink to {shorten(os.readlink(q), 120)}, outside {root}; "
                            f"FlexFloor writes only inside it: remove the link")


def refuse_held_run(path: Path, flag: str) -> None:
    """`path` (a file or folder an output flag names) is not, nor is inside, a run folder that a
    running `flexfloor train` (or rollout, export) holds: its metrics, config and checkpoints are that
    run's. Asked before the command takes its own lock, by the launching process alone (under
    torchrun the other ranks would find their own rank 0 holding it)."""
    run = run_folder_of(path.resolve().parent) or run_folder_of(path.resolve())
    if run is None or not driver_process() or not (holder := in_use_by(run)):
        return
    if run == path.resolve():  # the words `hold_out_dir` says it in
        raise OutDirInUse(f"{flag} {path}: in use by {holder}; wait for it to end, or choose another {flag}")
    raise OutDirInUse(f"{flag} {path}: is inside the run folder {run}, in use by {holder}; "
                      f"write it elsewhere, or wait for that run to end")


def write_file_atomically(path: Path, text: str) -> None:
    """`path` holds the old text or the new, never a part: written beside it, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def removed_if_refused(folder: str | Path, *inside: str):
    """If the body raises, remove what it created of `folder`, its parents and `folder/inside...`
    (a file there only if it did not exist before, a folder only if it is empty): a refused run
    leaves nothing behind, and never touches what was there."""
    folder = Path(folder)
    made = [p for p in (*reversed([folder, *folder.parents]), *(folder / i for i in inside))
            if not os.path.lexists(p)]
    try:
        yield
    except BaseException:
        for p in sorted(made, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        raise
