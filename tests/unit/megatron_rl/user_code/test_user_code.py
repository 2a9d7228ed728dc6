"""The user-file loader (in this process, as algorithms will load) and the worker pool's own rules:
concurrency over its workers, an answer checked for its shape, deadlines on the pipes."""
import os
import threading
import time

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.user_code import REWARD, UserFile, frames, load_user_function
from megatron_rl.user_code.pool import WorkerPool, _result
from tests.process_tree import live_children


def test_the_loader_imports_by_path_alone_and_guards_the_import(tmp_path):
    (tmp_path / "helper.py").write_text("X = 1\n")
    (tmp_path / "r.py").write_text("import sys\nTOP = sys.path[:]\ndef compute_score(*a):\n    return 2.0\n")
    fn = load_user_function(UserFile(REWARD, str(tmp_path / "r.py"), "compute_score"))
    assert fn() == 2.0 and str(tmp_path) not in fn.__globals__["TOP"]  # no folder added to the path
    assert "flexfloor_reward_r" not in __import__("sys").modules  # nothing another import could find
    (tmp_path / "g.py").write_text("def __getattr__(name):\n    raise SystemExit(4)\n")
    with pytest.raises(ConfigError, match=r"reward.path .*g.py: importing it failed \(SystemExit: 4\)"):
        load_user_function(UserFile(REWARD, str(tmp_path / "g.py"), "compute_score"))


def test_a_pool_of_two_runs_two_calls_at_once(tmp_path):
    (tmp_path / "slow.py").write_text("import time\ndef compute_score(*a):\n    time.sleep(1.5)\n    return 1\n")
    with WorkerPool(UserFile(REWARD, str(tmp_path / "slow.py"), "compute_score"), 10, size=2) as workers:
        workers.check_import()
        results, t = [], time.monotonic()
        threads = [threading.Thread(target=lambda: results.append(workers.call("s", "x", "1", {})))
                   for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert time.monotonic() - t < 2.9 and [r.value["score"] for r in results] == [1.0, 1.0]
    assert not live_children()


@pytest.mark.parametrize("reply, error", [
    (b"not json", "its worker sent an answer that is not one"),
    (b"[1, 2]", "its worker sent an answer that is not one"),
    (b'{"error": "x"}', "x"),
])
def test_an_answer_is_checked_for_its_shape(reply, error):
    assert _result(reply).error == error
    assert _result(b'{"value": {"score": 1.0, "extra": {}}}').value == {"score": 1.0, "extra": {}}


def test_a_pipe_read_past_its_deadline_is_late_and_a_closed_one_closed():
    r, w = os.pipe()
    with pytest.raises(frames.Late):
        frames.receive(r, time.monotonic() + 0.2)
    frames.send(w, b"hello", time.monotonic() + 1)
    assert frames.receive(r, time.monotonic() + 1) == b"hello"
    frames.send(w, b"x" * 100)
    with pytest.raises(ValueError, match="a frame of 100 bytes, above the limit of 10"):
        frames.receive(r, time.monotonic() + 1, limit=10)
    os.close(w)
    os.read(r, 100)
    with pytest.raises(frames.Closed):
        frames.receive(r, time.monotonic() + 1)
    os.close(r)


RANK = '''
import sys, threading, time
from megatron_rl.user_code import REWARD, UserFile
from megatron_rl.user_code.pool import WorkerPool

file = UserFile(REWARD, sys.argv[1], "compute_score")
quick, slow = WorkerPool(file, 1.0), WorkerPool(file, 600.0)
# a call that times out in a short-lived thread (a lease's): its worker's replacement outlives it
# (the thread waits for the replacement's import, so its PR_SET_PDEATHSIG is set when the thread ends)
t = threading.Thread(target=lambda: (quick.call("s", "hang", "1", {}), quick.check_import()))
t.start()
t.join()
time.sleep(0.5)  # join returns before the thread's exit in the kernel, which sends the signal
pids = [int(pool.call("s", "pid", "1", {}).value["extra"]["pid"]) for pool in (quick, slow)]
threading.Thread(target=slow.call, args=("s", "hang", "1", {}), daemon=True).start()
print(*pids, flush=True)
time.sleep(600)
'''


def test_workers_die_with_their_process_even_in_a_call_that_never_returns(tmp_path):
    """The SIGKILLed process here stands for a rank the launcher killed: its idle worker and its
    worker stuck in a call end with it (PR_SET_PDEATHSIG, tied to the spawner thread, not to the
    thread whose call started a replacement)."""
    import contextlib
    import signal
    import subprocess
    import sys

    (tmp_path / "r.py").write_text("import os, time\ndef compute_score(d, s, g, e=None):\n"
                                   "    if s == 'hang':\n        time.sleep(3600)\n"
                                   "    return {'score': 1.0, 'pid': os.getpid()}\n")
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "r.py")], stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        pids = [int(p) for p in rank.stdout.readline().split()]
        assert len(pids) == 2, "the replacement did not answer"
        time.sleep(0.5)  # the slow pool's worker is in its call
        assert all(os.path.exists(f"/proc/{p}") for p in pids)
        rank.send_signal(signal.SIGKILL)
        rank.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        rank.kill()
        rank.wait()
        for p in pids:  # a worker that outlived its process (the failure this test is for) is ended here
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that is gone."""
    try:
        return " Z " not in open(f"/proc/{pid}/stat").read().split(")", 1)[1][:4]
    except OSError:
        return False
