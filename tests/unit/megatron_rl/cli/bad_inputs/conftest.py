"""What the bad-input tests of every command share: the tiny train config, a trained run folder,
the bad files several commands are given, and the checks that a refusal is one line, exit 2, before
any rank starts."""
import fcntl
import sys
from types import SimpleNamespace

import pytest

from megatron_rl.cli import main
from tests.process_tree import live_children
from tests.process_tree import one_line_exit_2 as _one_line_exit_2
from tests.tiny_train import tiny_train_config

GOOD = '{"prompt_id": "a", "epoch": 0, "sample": 0, "prompt_len": 3, "response_len": 5}\n'


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    return tiny_train_config(tmp_path, steps=2, checkpoint={"every": 1, "export_hf": True})


@pytest.fixture
def run_folder(one_rank_group, tmp_path):
    from tests.tiny_train import tiny_run_folder

    return tiny_run_folder(tmp_path)


@pytest.fixture
def files(tmp_path):
    """Files in `tmp_path` that no command can use: `w(name, data)` writes one more."""
    tmp = tmp_path

    def w(name, data: bytes | str):
        p = tmp / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(p)

    trace = w("t.jsonl", GOOD)
    a_file = w("a_file", "x")
    latin1_trace = w("latin1.jsonl", GOOD.encode() + '{"prompt_id": "caf\xe9"}\n'.encode("latin-1"))
    latin1_yaml = w("latin1.yaml", "ranks: 2\n# caf\xe9\n".encode("latin-1"))
    broken_yaml = w("broken.yaml", "ranks: 2\nbatch: {trace: [\n")
    out = str(tmp / "out")
    loop, long = tmp / "loop1", str(tmp / ("n" * 256))  # a symlink loop; a name over 255 bytes
    loop.symlink_to(tmp / "loop2")
    (tmp / "loop2").symlink_to(loop)
    too_long = "bytes, over the file system's limit of 255"
    # a planted link in an output folder, out to a file of someone else's (every writer)
    planted, theirs = tmp / "planted", w("theirs.txt", "keep me")
    planted.mkdir()
    (planted / "report.json").symlink_to(theirs)
    (planted / "timeline.png").symlink_to(theirs)
    # a run folder a running train holds: its lock held here, as the train would
    held = tmp / "held"
    (held / "checkpoints").mkdir(parents=True)
    with open(held / ".flexfloor.lock", "a+", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield SimpleNamespace(tmp=tmp, w=w, trace=trace, a_file=a_file, latin1_trace=latin1_trace,
                              latin1_yaml=latin1_yaml, broken_yaml=broken_yaml, out=out, loop=loop, long=long,
                              too_long=too_long, planted=planted, theirs=theirs, held=held)


@pytest.fixture
def refuses_each(tmp_path, capsys, monkeypatch):
    """`refuses_each(command, cases)`: for each (argv, fragments) of `cases`, `flexfloor COMMAND ARGV`
    (run in `tmp_path`) is one line holding every fragment, exit 2, before any rank starts."""
    monkeypatch.chdir(tmp_path)

    def check(command, cases):
        for argv, fragments in cases:
            rc = main([command, *argv])
            out, err = capsys.readouterr()
            lines = err.strip().splitlines()
            assert rc == 2 and len(lines) == 1, (argv, rc, err[-2000:])
            assert lines[0].startswith(f"flexfloor {command}: error: "), (argv, lines)
            for f in fragments:
                assert f in lines[0], (argv, f, lines[0])
            assert "[rollout]" not in err and "[train] step" not in err
            assert not live_children(), (argv, "a process of the run is still alive")
        sys.stdout.flush()

    return check


@pytest.fixture
def refuses_value(capsys):
    """`refuses_value(argv, override, expect)`: `flexfloor ARGV OVERRIDE --print-config` is one line
    naming `expect`, blamed on the override. The values the commands' tests give hung a run
    (max_batch_per_rank=0), overflowed a timer or a seed into a traceback, or ran a NaN ledger to
    exit 0 on the old code."""
    def check(argv, override, expect):
        command = argv[0]
        line = _one_line_exit_2(capsys, [*argv, override, "--print-config"], expect)
        assert line.startswith(f"flexfloor {command}: error: {override[:20]}"), line

    return check
