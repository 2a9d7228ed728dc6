"""A custom reward file (`reward.kind: custom`): user code whose import, calls and return values are
judged, never trusted. A file that cannot load is one line, exit 2, before any rank starts
(`sys.exit(0)` at import included); a bad return value is a counted `error`, never a crash; what a
call does to its process (chdir, environment, threads, a hang) stays in the rank's reward worker;
and a step with too many errors stops the run before its update, with `latest` on the last good
step. Workers are one small process each, bounded by timeouts of 1-2 s."""
import json
import os
import sys
import time

import pytest

from megatron_rl.rewards import RewardConfig, RewardErrors, Scorer, check_error_share
from megatron_rl.user_code.pool import close_shared_pools
from tests.helpers.cli import cli
from tests.process_tree import live_children
from tests.tiny_train import tiny_train_config


@pytest.fixture(autouse=True)
def _end_reward_workers():
    yield
    close_shared_pools()


def _train_cfg(tmp_path, reward_py: str, name: str = "reward.py", **top) -> str:
    (tmp_path / name).write_text(reward_py)
    reward = {"kind": "custom", "path": str(tmp_path / name), "timeout_s": 2, **top.pop("reward", {})}
    return str(tiny_train_config(tmp_path, reward=reward, **top))


def test_a_reward_file_that_cannot_load_is_one_line_exit_2_before_any_rank(tmp_path, refuses_each, monkeypatch):
    monkeypatch.setattr("megatron_rl.user_code.pool.IMPORT_TIMEOUT_S", 2.0)
    ok = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"

    def case(name, source, *fragments, file="reward.py"):
        folder = tmp_path / name
        folder.mkdir()
        return ["--config", _train_cfg(folder, source, file)], list(fragments)

    missing = tmp_path / "nope"
    missing.mkdir()
    refuses_each("train", [
        case("exit0", "import sys\nsys.exit(0)\n" + ok, "reward.path ", "importing it failed (SystemExit: 0)"),
        case("ctrlc", "raise KeyboardInterrupt\n", "importing it failed (KeyboardInterrupt)"),
        case("raises", "import no_such_module_here\n", "importing it failed (ModuleNotFoundError: No module named"),
        case("syntax", "def compute_score(:\n", "importing it failed (SyntaxError: "),
        case("osexit", "import os\nos._exit(0)\n", "importing it ended its worker process (exit status 0)"),
        case("hangs", "while True:\n    pass\n", "importing it did not finish within 2 s"),
        case("noname", "def other(): pass\n", "reward.name compute_score: ", "defines no function of that name"),
        case("txt", ok, "not a Python file (expected a .py file defining compute_score)", file="reward.txt"),
        (["--config", str(tiny_train_config(missing, reward={"kind": "custom", "path": str(missing / "r.py")}))],
         [f"reward.path {missing / 'r.py'}: no such file"]),
    ])


VALUES_PY = '''
import decimal, fractions, math

class Evil:  # looks like a 0-d tensor, fails when read
    shape = ()

    def item(self):
        raise RuntimeError("no item here")

def value(key):
    if key.startswith("np."):
        import numpy as np
        return {"np.float32": np.float32(0.5), "np.int64": np.int64(1), "np.0d": np.array(0.25),
                "np.bool": np.bool_(True), "np.vector": np.zeros(2)}[key]
    if key.startswith("torch."):
        import torch
        return {"torch.0d": torch.tensor(0.75), "torch.vector": torch.tensor([1.0, 2.0]),
                "torch.dict": {"score": torch.tensor(1.0), "acc": torch.tensor(0.5)}}[key]
    return {
        "int": 1, "float": 0.5, "decimal": decimal.Decimal("0.25"), "fraction": fractions.Fraction(1, 4),
        "dict": {"score": 1, "acc": 0.5, "pred": "42", "steps": [1, 2]},
        "big": 10**400, "big_in_dict": {"score": 10**400}, "nan": math.nan, "inf": -math.inf,
        "nan_extra": {"score": 1.0, "acc": math.nan}, "text": "1.0", "none": None, "bool": True,
        "int_key": {1: 2.0, "score": 1.0}, "no_score": {"acc": 1.0}, "list": [1.0], "evil": Evil(),
        "long_key": {"score": 1.0, "k" * 65: 1.0},
    }[key]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return value(solution_str)
'''

SCORED = {"int": 1.0, "float": 0.5, "decimal": 0.25, "fraction": 0.25, "dict": 1.0, "np.float32": 0.5,
          "np.int64": 1.0, "np.0d": 0.25, "torch.0d": 0.75, "torch.dict": 1.0}
ERRORS = ["big", "big_in_dict", "nan", "inf", "nan_extra", "text", "none", "bool", "int_key", "no_score", "list",
          "evil", "long_key", "np.bool", "np.vector", "torch.vector"]


def test_any_real_number_scores_and_every_other_return_is_a_counted_error(tmp_path, capsys):
    """Python, numpy and 0-d torch values, alone or as a dict's `score`, count; non-finite,
    overflowing and non-numeric values and bad keys are each an `error` (first printed once),
    never a crash. (The values verl accepts that scored `error` here, and 10**400 and int keys
    that crashed every rank.)"""
    (tmp_path / "values.py").write_text(VALUES_PY)
    # torch's first import in the worker takes seconds on a loaded machine
    s = Scorer(RewardConfig(kind="custom", path=str(tmp_path / "values.py"), timeout_s=60, unparsable_reward=-1.0))
    got = {key: s(key, "1") for key in [*SCORED, *ERRORS]}
    assert {k: got[k] for k in SCORED} == SCORED
    assert {k: got[k] for k in ERRORS} == {k: -1.0 for k in ERRORS}
    assert s.take_extras() == {"acc": (1.0, 2)}  # dict's 0.5 and torch.dict's 0.5; text and lists not logged
    counts = s.take_counts()
    assert counts["scored"] == len(SCORED) and counts["error"] == len(ERRORS)
    err = capsys.readouterr().err
    assert err.count("[reward]") == 1, err
    assert "returned an int of 1329 bits, which overflows a float" in err


def test_each_bad_return_names_what_it_was(tmp_path, capsys):
    from megatron_rl.user_code import REWARD, UserFile
    from megatron_rl.user_code.pool import WorkerPool

    (tmp_path / "values.py").write_text(VALUES_PY)
    expect = {"big": "returned an int of 1329 bits, which overflows a float",
              "nan_extra": "returned 'acc' nan, which is not finite",
              "int_key": "returned a dict with the key 1 (int); keys must be strings",
              "no_score": "returned a dict without 'score' (keys: acc)",
              "bool": "returned True (bool), expected a real number",
              "evil": "reading what it returned raised RuntimeError: no item here",
              "long_key": "keys must be strings of 1 to 64 characters"}
    with WorkerPool(UserFile(REWARD, str(tmp_path / "values.py"), "compute_score"), 10) as workers:
        for key, words in expect.items():
            result = workers.call("s", key, "1", {})
            assert result.value is None and words in result.error, (key, result)


CONTAINED_PY = '''
import os, threading, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "escape":
        os.chdir("/")
        os.environ["FLEXFLOOR_REWARD_ESCAPED"] = "1"
        threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon: it would hold an exit
    if solution_str == "hang":
        while True:
            pass
    if solution_str == "exit":
        raise SystemExit(3)
    return {"score": 1.0, "pid": os.getpid(), "escaped": float("FLEXFLOOR_REWARD_ESCAPED" in os.environ)}
'''


def _pid(scorer) -> int:
    scorer("ok", "1")
    return int(scorer.take_extras()["pid"][0])


def test_what_a_reward_does_to_its_process_stays_in_its_worker(tmp_path, capsys):
    (tmp_path / "contained.py").write_text(CONTAINED_PY)
    cwd = os.getcwd()
    s = Scorer(RewardConfig(kind="custom", path=str(tmp_path / "contained.py"), timeout_s=1))
    first = _pid(s)
    assert first != os.getpid()
    assert s("escape", "1") == 1.0 and s("exit", "1") == 0.0  # SystemExit in a call: an error, not an exit
    assert s.take_extras()["escaped"] == (1.0, 1)  # the worker's environment changed ...
    assert os.getcwd() == cwd and "FLEXFLOOR_REWARD_ESCAPED" not in os.environ  # ... the rank's did not
    assert _pid(s) == first  # and the worker lives on
    t = time.monotonic()
    assert s("hang", "1") == 0.0 and time.monotonic() - t < 10  # bounded by timeout_s (1 s) + a kill
    second = _pid(s)
    assert second != first and not os.path.exists(f"/proc/{first}")  # ended (thread and all), replaced
    assert s.take_counts()["error"] == 2
    assert "SystemExit: 3" in capsys.readouterr().err
    close_shared_pools()
    assert not live_children()


def test_many_timeouts_in_a_step_end_its_other_calls_in_one_line(tmp_path, capsys):
    """A reward that hangs on every response costs a rank 3 x timeout_s per step, not its whole share."""
    (tmp_path / "contained.py").write_text(CONTAINED_PY)
    s = Scorer(RewardConfig(kind="custom", path=str(tmp_path / "contained.py"), timeout_s=1))
    t = time.monotonic()
    assert [s("hang", "1") for _ in range(12)] == [0.0] * 12
    assert time.monotonic() - t < 12  # 3 timeouts of 1 s (and restarts), then no call
    assert s.take_counts()["error"] == 12  # the step ends: the next one calls again
    err = capsys.readouterr().err
    assert err.count("3 calls ran past reward.timeout_s 1s in this step") == 1
    assert s("ok", "1") == 1.0


def test_scoring_leases_use_the_same_workers(tmp_path):
    from megatron_rl.data.tokenizer import CharTokenizer
    from megatron_rl.rl.rollout_phase.leases import TrainingLeases
    from megatron_rl.trainer_config import TrainerConfig

    (tmp_path / "contained.py").write_text(CONTAINED_PY)
    cfg = RewardConfig(kind="custom", path=str(tmp_path / "contained.py"), timeout_s=1)
    phase, leases = Scorer(cfg), TrainingLeases(TrainerConfig(reward=cfg, ranks=2), CharTokenizer(), 0, 1)
    assert leases.scorer.custom.workers is phase.custom.workers
    assert _pid(phase) == _pid(leases.scorer)


def test_a_step_with_too_many_errors_stops_before_its_update(tmp_path):
    """Step 1 scores; from step 2 every call raises SystemExit(0): the run stops in one line naming
    step 2 (exit status 2, not the 0 a `sys.exit` in user code used to give), before step 2's update,
    and `latest` stays step 1."""
    calls = tmp_path / "calls"
    reward = f'''
import os, sys

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    fd = os.open({str(calls)!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, b"x")
    n = os.fstat(fd).st_size
    os.close(fd)
    if n > 16:  # one step: 4 prompts x 4 responses, over both ranks
        sys.exit(0)
    return 1.0
'''
    cfg = _train_cfg(tmp_path, reward, checkpoint={"every": 1, "export_hf": False}, steps=3)
    out = tmp_path / "out"
    # A process of its own: ranks a forkserver starts write to the stderr it was started with, which
    # in this test process may be an earlier test's capture.
    proc = cli("train", "--config", cfg, "--out", out, "logging.wandb_mode=disabled")
    err = proc.stderr  # the ranks' lines too
    lines = [line for line in err.strip().splitlines() if not line.startswith("[")]
    assert proc.returncode == 2 and len(lines) == 1, err[-3000:]
    assert "step 2: 16 of 16 responses scored error" in lines[0] and "above reward.max_error_share 0.5" in lines[0]
    assert err.count("compute_score: SystemExit: 0 (counted as reward/outcomes/error") == 2  # once a rank
    assert (out / "checkpoints" / "latest").read_text() == "step_000001"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not live_children()


def test_a_step_where_every_response_errored_says_so_where_it_may_go_on(capsys):
    counts = {"correct": 0, "scored": 0, "error": 16}
    assert check_error_share(3, counts, 1.0, rank=0) == {"reward_all_error": 1}
    assert "[train] step 3: EVERY RESPONSE (16 of 16) SCORED error" in capsys.readouterr().err
    assert check_error_share(3, counts, 1.0, rank=1) == {"reward_all_error": 1} and not capsys.readouterr().err
    assert check_error_share(3, {"scored": 8, "error": 8}, 0.5, rank=0) == {}  # at the bound: goes on
    with pytest.raises(RewardErrors, match="^step 3: 9 of 16 responses scored error"):
        check_error_share(3, {"scored": 7, "error": 9}, 0.5, rank=0)
    assert check_error_share(3, {"correct": 16, "error": 0}, 0.0, rank=0) == {}


@pytest.mark.parametrize("value, expect", [("-0.1", "expected a share in [0, 1], got -0.1"),
                                           ("1.5", "expected a share in [0, 1], got 1.5"),
                                           (".nan", "expected a finite number, got nan")])
def test_max_error_share_is_a_share(tmp_path, refuses_value, value, expect):
    cfg = tiny_train_config(tmp_path)
    refuses_value(["train", "--config", cfg, "--out", tmp_path / "out"], f"reward.max_error_share={value}",
                  f"reward.max_error_share: {expect}")


def test_a_reward_writes_no_byte_of_the_clis_stdout(tmp_path, capfd):
    """What a reward prints goes to the rank's stderr: stdout is the CLI's (a JSON summary)."""
    (tmp_path / "loud.py").write_text("def compute_score(*a):\n    print('debug from the reward')\n    return 1\n")
    s = Scorer(RewardConfig(kind="custom", path=str(tmp_path / "loud.py")))
    assert s("x", "1") == 1.0
    close_shared_pools()
    out, err = capfd.readouterr()
    assert "debug from the reward" in err and "debug" not in out
    sys.stdout.flush()
