"""A full disk is found however a writer reports it (megatron_rl/parallel/disk_full.py)."""
import errno
import os
from types import SimpleNamespace

from megatron_rl.parallel.disk_full import DiskFull, disk_full


def _raised(e, cause=None):
    try:
        raise e from cause
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_an_enospc_anywhere_in_the_chain_names_its_file_or_the_run_folder(tmp_path):
    named = _raised(RuntimeError("cannot write the checkpoint"), OSError(errno.ENOSPC, "No space", "/r/metrics.jsonl"))
    assert str(disk_full(named, tmp_path)) == "no space left on device: /r/metrics.jsonl"
    try:
        with open("/dev/full", "w") as fh:  # a buffered write: the OSError names no file
            fh.write("x")
    except OSError as e:
        unnamed = _raised(ValueError("wrapped"), e)
    assert str(disk_full(unnamed, tmp_path)) == f"no space left on device: {tmp_path}"
    quota = OSError(errno.EDQUOT, "Disk quota exceeded", "/r/x")
    assert isinstance(disk_full(quota), DiskFull) and str(disk_full(quota)) == "disk quota exceeded: /r/x"
    assert disk_full(_raised(RuntimeError("save failed"), OSError(errno.EACCES, "Permission denied"))) is None
    # DCP's CheckpointException holds each rank's failure as (exception, stack)
    gathered = Exception("CheckpointException")
    gathered.failures = {1: (OSError(errno.ENOSPC, "No space", "/r/__1_0.distcp"), None)}
    assert str(disk_full(gathered)) == "no space left on device: /r/__1_0.distcp"


def test_an_error_that_lost_its_oserror_is_a_full_disk_when_the_folder_has_no_room(tmp_path, monkeypatch):
    """torch's zip writer says "unexpected pos 704 vs 598", and DCP's pickling drops its OSError."""
    zip_writer = _raised(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    assert disk_full(zip_writer, tmp_path) is None  # room left: someone else's problem
    real = os.statvfs(tmp_path)
    full = SimpleNamespace(f_bfree=1, f_bavail=0, f_frsize=real.f_frsize)
    monkeypatch.setattr(os, "statvfs", lambda p: full)
    assert str(disk_full(zip_writer, tmp_path)) == f"no space left on device: {tmp_path}"
    assert disk_full(zip_writer, None) is None
