"""Spawned ranks share the launcher's stderr; each line a rank prints arrives whole, never spliced
with another rank's (Python's stderr writes a line and its newline apart: "[a] x[b] y", then an
empty line, broke one-line error checks on a loaded machine)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.parallel.launch import run_ranks

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
LINES = 2000


def _print_lines(ctx):
    for i in range(LINES):
        print(f"[rank {ctx.rank}] line {i} of a message long enough to take a while to write", file=sys.stderr)
    return "ok"


def main():
    run_ranks(_print_lines, 2, timeout_s=120)


def test_lines_of_two_ranks_on_one_stderr_arrive_whole():
    proc = subprocess.run([sys.executable, "-c", "from tests.distributed.test_rank_stderr import main; main()"],
                          cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank") or not ln.strip()]
    whole = re.compile(r"\[rank [01]\] line \d+ of a message long enough to take a while to write")
    spliced = [ln for ln in lines if not whole.fullmatch(ln)]
    assert not spliced and len(lines) == 2 * LINES, spliced[:5]
