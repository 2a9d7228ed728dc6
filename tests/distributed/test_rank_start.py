"""The launcher's ranks fork from one fork server (megatron_rl/parallel/rank_start.py), yet each
launch's ranks see that launch's environment and folder, as spawned ranks would; a changed
start-time variable (here PYTHONPATH, naming a sitecustomize that only an interpreter's start runs,
as tests/megatron_harness.py's does) makes the launch spawn instead.

Run in a fresh launcher process, so the fork server starts here and nowhere earlier."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]

PROG = '''
import json, os, sys
from megatron_rl.parallel.launch import run_ranks

def where(ctx):
    import builtins
    return [os.getppid(), os.environ.get("FF_MARK"), os.getcwd(), getattr(builtins, "FF_SITE", False)]

if __name__ == "__main__":
    os.environ["FF_MARK"] = "a"
    launches = [run_ranks(where, 2, timeout_s=60)]
    os.environ["FF_MARK"] = "b"
    os.chdir(sys.argv[1])
    launches.append(run_ranks(where, 2, timeout_s=60))
    os.environ["FF_MARK"] = "c"
    os.environ["PYTHONPATH"] = sys.argv[2] + os.pathsep + os.environ["PYTHONPATH"]  # a sitecustomize
    launches.append(run_ranks(where, 2, timeout_s=60))
    print(json.dumps({"launcher": os.getpid(), "launches": launches}))
'''


def test_forked_ranks_see_each_launchs_environment_and_a_start_time_change_spawns(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import builtins\nbuiltins.FF_SITE = True\n")
    # A TMPDIR longer than an AF_UNIX socket path may be (as a cluster's per-job one often is): the
    # fork server's socket lives in a short private folder anyway.
    long_tmp = tmp_path / ("t" * 110)
    long_tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(long_tmp)}
    proc = subprocess.run([sys.executable, str(prog), str(tmp_path / "elsewhere"), str(tmp_path / "site")],
                          cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (p1, m1, d1, s1), (p2, m2, d2, s2), (p3, m3, _, s3) = out["launches"]
    server = p1
    assert server != out["launcher"] and p2 == server, "the first two launches fork from one server"
    assert (m1, m2, m3) == ("a", "b", "c")
    assert (d1, d2) == (str(tmp_path), str(tmp_path / "elsewhere"))
    assert not s1 and not s2
    assert p3 == out["launcher"] and s3, "PYTHONPATH changed: spawned, and its sitecustomize ran"
