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


def lines(path: Path) -> list[str]:
    """The lines of a file a run is still writing ([] before it exists)."""
    return path.read_text().splitlines() if path.exists() else []


def training_started(cfg: Path, out: Path) -> subprocess.Popen:
    """`flexfloor train --config CFG --out OUT` (W&B off), returned once its first step is logged."""
    proc = flexfloor("train", "--config", str(cfg), "--out", str(out), env={"WANDB_MODE": "disabled"})
    wait_for(lambda: len(lines(out / "metrics.jsonl")) >= 1, 120, "the first step", proc)
    return proc


def _processes():
    """(pid, state, ppid, pgrp) of every process, from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, ppid, pgrp = text[text.rindex(")") + 2:].split()[:3]  # after "pid (comm) "
        yield int(stat.parent.name), state, int(ppid), int(pgrp)


def _cmd(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def rank_pids(launcher: int) -> list[int]:
    """The ranks a flexfloor launcher started, in start order: children of its fork server
    (megatron_rl/parallel/rank_start.py), or its own children when it spawned them."""
    procs = list(_processes())
    servers = {pid for pid, _, ppid, _ in procs if ppid == launcher and b"multiprocessing.forkserver" in _cmd(pid)}
    return sorted(pid for pid, state, ppid, _ in procs if state != "Z" and (
        ppid in servers or (ppid == launcher and b"spawn_main" in _cmd(pid))))


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
    """`pid` and the start of its command line, for a failure message."""
    return f"{pid}: " + _cmd(pid).replace(b"\0", b" ").decode(errors="replace")[:120]


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
    """Running (non-zombie) processes `pid` (default: this process) started, its fork server's
    children (the ranks, megatron_rl/parallel/rank_start.py) included, less multiprocessing's
    resource tracker and the fork server: one each per interpreter, they outlive every run by design."""
    pid = os.getpid() if pid is None else pid
    procs = list(_processes())
    helpers = {p for p, _, ppid, _ in procs if ppid == pid and (
        b"resource_tracker" in _cmd(p) or b"multiprocessing.forkserver" in _cmd(p))}
    return [p for p, state, ppid, _ in procs if state != "Z" and p not in helpers and (
        ppid == pid or ppid in helpers)]


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
