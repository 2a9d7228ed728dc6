"""One run per --out; SIGHUP (a closed terminal, a dropped SSH session)
saves and stops `train` like SIGTERM; a training collective that times out is one line naming rank,
step and phase. Each run is its own process group; none may remain."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.files.out_lock import LOCK_NAME, OutDirInUse, hold_out_dir
from megatron_rl.parallel.signals import GRACE_S
from tests.process_tree import assert_group_gone, finish, flexfloor, lines, rank_pids, training_started
from tests.tiny_train import tiny_train_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_second_run_on_the_same_out_is_refused_and_sighup_saves_and_exits_0(tmp_path):
    cfg = tiny_train_config(tmp_path, steps=500)
    out = tmp_path / "out"
    first = training_started(cfg, out)
    config = (out / "config.yaml").read_text()
    second = flexfloor("train", "--config", str(cfg), "--out", str(out), "seed=1", env={"WANDB_MODE": "disabled"})
    rc, _, err, _ = finish(second, 120)
    said = err.strip().splitlines()
    assert rc == 2 and len(said) == 1, err[-2000:]
    assert f"--out {out}: in use by pid {first.pid} (`flexfloor train`, started " in said[0], said
    assert (out / "config.yaml").read_text() == config  # nothing of the first run was touched
    assert_group_gone(second.pid)
    first.send_signal(signal.SIGHUP)
    rc, stdout, err, _ = finish(first, 120)
    assert rc == 0, err[-3000:]
    done = len(lines(out / "metrics.jsonl"))
    assert f"stopped by SIGHUP after step {done} (checkpoint saved)" in stdout, stdout
    assert f"-> step {done} " in stdout, stdout  # not "-> step 500"
    assert (out / "checkpoints" / "latest").read_text() == f"step_{done:06d}"
    assert_group_gone(first.pid)


def test_the_lock_of_a_killed_holder_is_reclaimed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from megatron_rl.files.out_lock import hold_out_dir\n"
        f"with hold_out_dir({str(tmp_path)!r}, 'train'):\n    print('held', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutDirInUse, match=f"in use by pid {holder.pid}"):
            with hold_out_dir(tmp_path, "rollout"):
                pass
    finally:
        holder.kill()
        holder.wait(10)
    assert (tmp_path / LOCK_NAME).exists()  # left behind by the SIGKILL, and no obstacle
    t0 = time.monotonic()
    with hold_out_dir(tmp_path, "rollout"):
        pass
    assert time.monotonic() - t0 < 1


def test_a_frozen_rank_in_training_is_one_line_naming_rank_step_and_phase(tmp_path):
    cfg = tiny_train_config(tmp_path, steps=500, timeout_s=2.0)
    out = tmp_path / "out"
    proc = training_started(cfg, out)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2, ranks
    os.kill(max(ranks), signal.SIGSTOP)
    rc, _, err, waited = finish(proc, 120)
    line = err.strip().splitlines()[-1]
    assert rc == 2 and len([x for x in err.strip().splitlines() if not x.startswith("[")]) == 1, err[-3000:]
    assert re.search(r"failed: rank \d, step \d+, (stage \d+, )?phase [\w-]+: ", line), line
    assert "did not end and were killed" in line, line
    assert waited < 2 * 2.0 + 5 + GRACE_S + 20, waited
    assert_group_gone(proc.pid)
