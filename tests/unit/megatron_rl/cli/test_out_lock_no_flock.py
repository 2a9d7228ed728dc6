"""The run-folder lock on a file system without flock (Lustre, NFS without locks): an O_EXCL file."""
from __future__ import annotations

import errno
import json
import socket
import subprocess
import sys

import pytest

from megatron_rl.files import out_lock
from megatron_rl.files.out_lock import EXCL_NAME, OutDirInUse, hold_out_dir


@pytest.fixture
def no_flock(monkeypatch):
    def flock(_fh, _op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(out_lock.fcntl, "flock", flock)


def test_without_flock_an_exclusive_lock_file_holds_the_folder_and_says_so(tmp_path, no_flock, capsys):
    with hold_out_dir(tmp_path, "train"):
        info = json.loads((tmp_path / EXCL_NAME).read_text())
        assert info["host"] == socket.gethostname() and info["pid"] > 0
        with pytest.raises(OutDirInUse, match=rf"in use by pid {info['pid']} on {socket.gethostname()}"):
            with hold_out_dir(tmp_path, "rollout"):
                pass
    assert not (tmp_path / EXCL_NAME).exists()
    line = capsys.readouterr().err.strip().splitlines()[0]
    assert line.endswith(f"the file system has no flock (No locks available); locking with {EXCL_NAME} "
                         "(O_EXCL, PID and host) instead")


def test_a_dead_holders_lock_file_is_stale_and_taken_over_another_hosts_is_refused(tmp_path, no_flock):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    lock = tmp_path / EXCL_NAME
    lock.write_text(json.dumps({"pid": int(dead), "host": socket.gethostname()}))
    with hold_out_dir(tmp_path, "train"):
        assert json.loads(lock.read_text())["pid"] != int(dead)
    lock.write_text(json.dumps({"pid": 1, "host": "gpu07"}))
    with pytest.raises(OutDirInUse, match=rf"in use by pid 1 on gpu07 .*delete {lock} if that run is gone"):
        with hold_out_dir(tmp_path, "train"):
            pass


def test_a_dead_holders_lock_file_does_not_make_its_run_look_in_use(tmp_path):
    """`in_use_by` (asked by `export --to` and the output flags) judges a lock file as taking it does."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    lock = tmp_path / EXCL_NAME
    lock.write_text(json.dumps({"pid": int(dead), "host": socket.gethostname()}))
    assert out_lock.in_use_by(tmp_path) is None
    lock.write_text(json.dumps({"pid": 1, "host": "gpu07"}))
    assert out_lock.in_use_by(tmp_path) == f"pid 1 on gpu07 ({lock})"
    lock.write_text("not json")
    assert out_lock.in_use_by(tmp_path) == f"a holder the file does not name ({lock})"
