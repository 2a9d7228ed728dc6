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
