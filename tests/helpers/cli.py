"""`flexfloor` as a user runs it: `python -m megatron_rl.cli` in a subprocess from the repository root
(so the checkout's code runs, not an installed copy)."""
import os
import subprocess
import sys

from tests.helpers import REPO


def cli(*args, expect: int | None = None, env: dict | None = None, timeout: float = 500,
        cwd=REPO) -> subprocess.CompletedProcess:
    """`flexfloor ARGS` (each passed through str) run to its end, output captured. With `expect`, its
    exit status must be that (the failure shows stderr's tail); `env` is added to this process's."""
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", *map(str, args)], cwd=cwd,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if expect is not None:
        assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}\n{proc.stderr[-3000:]}"
    return proc


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The single stderr line of a run that stopped on bad input (exit 2, no traceback), holding
    every fragment; returns the line."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert all(f in lines[0] for f in fragments), (fragments, lines[0])
    return lines[0]


def listing(folder) -> list[str]:
    """Every path below `folder`, relative to it, sorted: what a refused command must leave as it was."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
