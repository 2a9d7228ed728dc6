"""A signal to the launcher, a crashed rank or a frozen one ends every rank.

Each run is its own process group; afterwards no process of it may remain.
"""
import signal
import sys
from pathlib import Path

import pytest

from megatron_rl.parallel.signals import GRACE_S
from tests.process_tree import assert_group_gone, finish, start, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
PROG = str(Path(__file__).with_name("ranks_prog.py"))


def _ranks_up(d: Path, n: int = 2):
    return lambda: all((d / f"rank{r}.pid").exists() for r in range(n))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
def test_a_signal_to_the_launcher_ends_every_rank(tmp_path, sig):
    proc = start([sys.executable, PROG, "sleep", str(tmp_path)])
    wait_for(_ranks_up(tmp_path), 90, "both ranks", proc)
    proc.send_signal(sig)
    rc, _, err, waited = finish(proc, 30)
    assert rc == 128 + sig, err
    assert err.strip().splitlines()[-1].startswith(f"ranks_prog: interrupted by {sig.name}"), err
    assert waited < 15, waited
    assert_group_gone(proc.pid)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_a_stop_is_reported_as_the_signal_the_user_sent(tmp_path, sig):
    """The ranks see a Ctrl+C as the SIGTERM the launcher forwards; the report names SIGINT."""
    proc = start([sys.executable, PROG, "stop", str(tmp_path)])
    wait_for(_ranks_up(tmp_path), 90, "both ranks", proc)
    proc.send_signal(sig)
    rc, _, err, _ = finish(proc, 60)
    assert rc == 0 and err.strip().splitlines()[-1] == f"ranks_prog: stopped by {sig.name}", err
    assert_group_gone(proc.pid)


def test_a_crashed_rank_ends_one_that_ignores_sigterm(tmp_path):
    # rank 1 exits 3; rank 0 treats SIGTERM as a flag (as the trainer does), so only SIGKILL ends it.
    proc = start([sys.executable, PROG, "stubborn", str(tmp_path)])
    wait_for(_ranks_up(tmp_path), 90, "both ranks", proc)
    rc, _, err, waited = finish(proc, 60)
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert "rank 1 died (exit code 3)" in line and "rank(s) 0 did not end and were killed" in line, err
    assert waited < 5 + 2 * GRACE_S + 10, waited
    assert_group_gone(proc.pid)


def test_a_frozen_rank_is_killed_within_timeout_plus_grace(tmp_path):
    timeout_s = 3.0
    proc = start([sys.executable, PROG, "barrier", str(tmp_path), str(timeout_s)])
    wait_for(_ranks_up(tmp_path), 90, "both ranks", proc)
    frozen = int((tmp_path / "rank1.pid").read_text())
    import os

    os.kill(frozen, signal.SIGSTOP)
    rc, _, err, waited = finish(proc, 90)
    assert rc == 2, err
    assert "rank(s) 1 did not end and were killed" in err, err
    # rank 0's barrier times out (gloo may take two timeouts), 5 s for context, then the grace.
    assert waited < 2 * timeout_s + 5 + GRACE_S + 10, waited
    assert_group_gone(proc.pid)
