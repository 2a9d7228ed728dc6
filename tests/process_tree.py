"""Start a CLI as its own process group, and check that nothing of it is left afterwards."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start(argv: list[str], cwd: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    """`argv` in a new session (its own process group), the checkout on PYTHONPATH, output captured."""
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.Popen(argv, cwd=cwd or REPO, env=env, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def flexfloor(*args: str, **kw) -> subprocess.Popen:
    return start([sys.executable, "-m", "megatron_rl.cli", *args], **kw)


def _processes():
    """(pid, state, ppid, pgrp) of every process, from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, ppid, pgrp = text[text.rindex(")") + 2:].split()[:3]  # after "pid (comm) "
        yield int(stat.parent.name), state, int(ppid), int(pgrp)


def live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that still run (zombies, already dead, do not count)."""
    return [pid for pid, state, _, pgrp in _processes() if state != "Z" and pgrp == pgid]


def assert_group_gone(pgid: int, within_s: float = 15.0) -> None:
    """Every process of the run has ended (the launcher's ranks and helpers included)."""
    deadline = time.monotonic() + within_s
    while live_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = live_members(pgid)
    assert not left, f"processes of the run still alive: {[_cmdline(p) for p in left]}"


def _cmdline(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return str(pid)


def wait_for(pred, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} while waiting for {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, str, float]:
    """Wait for the launcher; (exit status, stdout, stderr, seconds waited). Kills the group if late."""
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout_s} s:\n{err[-2000:]}") from None
    return proc.returncode, out, err, time.monotonic() - t0


def live_children(pid: int | None = None) -> list[int]:
    """Running (non-zombie) child processes of `pid` (default: this process), less multiprocessing's
    resource tracker: one per interpreter, it outlives every run by design."""
    pid = os.getpid() if pid is None else pid
    return [p for p, state, ppid, _ in _processes()
            if state != "Z" and ppid == pid and "resource_tracker" not in _cmdline(p)]


def one_line_exit_2(capsys, argv, *fragments) -> str:
    """`flexfloor ARGV` in process exits 2 with one short error line holding every fragment, and
    leaves no rank alive; returns the line."""
    from megatron_rl.cli import main

    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("[")]  # progress lines
    assert rc == 2 and len(lines) == 1, (argv, err[-3000:])
    assert len(lines[0]) < 600, lines[0][:1000]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert not live_children(), "a rank of the run is still alive"
    return lines[0]
