"""Issue 23: inputs that cannot work are one line and exit 2 before any rank starts; the CLI as a
user types it, in process (`megatron_rl.cli.main`), so each case costs a config read, not a run."""
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.cli import main
from tests.process_tree import one_line_exit_2 as _one_line_exit_2
from tests.tiny_train import tiny_train_config


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    return tiny_train_config(tmp_path, steps=2, checkpoint={"every": 1, "export_hf": True})


def _trace(path, response_len=8, epochs=2, extra=None):
    with open(path, "w") as fh:
        for e in range(epochs):
            for p in range(8):
                fh.write(json.dumps({"prompt_id": f"p{p}", "epoch": e, "sample": 0, "prompt_len": 8,
                                     "response_len": response_len if p == 0 else 8}) + "\n")
        if extra:
            fh.write(extra + "\n")
    return path


# (command, override, what the one line names). Every value here hung a run (max_batch_per_rank=0),
# overflowed a timer or a seed into a traceback, or ran a NaN ledger to exit 0 on the old code.
BAD_VALUES = [
    ("train", "generation.max_batch_per_rank=0", "generation.max_batch_per_rank: expected > 0"),
    ("train", "timeout_s=.inf", "expected a finite number"),
    ("train", "timeout_s=1e300", "timeout_s: expected seconds in [1,"),
    ("train", "timeout_s=0.01", "timeout_s: expected seconds in [1,"),
    ("train", "seed=-1", "seed: expected an integer in [0, 2^32)"),
    ("train", "seed=100000000000000000000000", "expected an integer of at most 2^63 - 1"),
    ("train", "optim.lr=.nan", "expected a finite number"),
    ("train", "checkpoint.stop_grace_s=1e300", "checkpoint.stop_grace_s: expected seconds"),
    ("train", "leases.lease_s=1e9", "leases.lease_s: expected seconds"),
    ("train", "data.template='{prompt} {x}'", "only {prompt} may be filled in, got {x}"),
    ("train", "data.template='{prompt} {'", "Single '{'"),
    ("train", "data.template='{0}{prompt}'", "got {0}"),
    ("train", "generation.max_response_len=4096", "must be below model.max_position_embeddings"),
    ("train", "grpo.group_size=1000000", "grpo.group_size 1000000 = 4e+06 responses per rollout, above the "
                                          "limit of 2^20"),
    ("train", "partial.over_sample=-1", "partial.over_sample: expected a number >= 0"),  # also when off
    ("train", "partial.token_budget=-1", "partial.token_budget: only read with end 'budget'"),
    ("rollout", "max_batch_per_rank=0", "max_batch_per_rank must be > 0"),
    ("rollout", "batch.prompts=100000000", "batch.prompts x samples x epochs: expected an integer in [1, 2^24]"),
    ("train", "model.vocab_size=1000000000000", "vocab_size: expected an integer in [1, 2^24]"),
    ("rollout", "sampling.seed=-1", "sampling.seed: expected an integer in [0, 2^32)"),
    ("rollout", "fault=bogus", "expected one of 'kill-leased-rank', 'fail-transfer', 'stuck-lease' or null"),
    ("simulate", "cost.step_overhead_s=.inf", "expected a finite number"),
    ("plan", "seed=-1", "seed: expected an integer in [0, 2^32)"),
]


@pytest.mark.parametrize("command,override,expect", BAD_VALUES, ids=[b[1] for b in BAD_VALUES])
def test_a_value_that_would_hang_or_crash_is_one_line(cfg, tmp_path, capsys, command, override, expect):
    if command == "train":
        argv = ["train", "--config", cfg, "--out", tmp_path / "out"]
    elif command == "rollout":
        argv = ["rollout", "--ranks", "2"]
    else:
        argv = [command, "--trace", _trace(tmp_path / "t.jsonl"), "--ranks", "4", "--floor", "2"]
    line = _one_line_exit_2(capsys, [*argv, override, "--print-config"], expect)
    assert line.startswith(f"flexfloor {command}: error: {override[:20]}"), line


def test_partial_bounds_blame_the_field_the_error_names(cfg, tmp_path, capsys):
    """Issue 31 defects 10 and 29: over_sample is capped by a rollout's response limit and by the
    dataset; an error is blamed on the override it names, not on the one that made the check run."""
    on = ["partial.enabled=true", "grpo.tis_cap=2"]
    train = ["train", "--config", cfg, "--out", tmp_path / "out"]
    line = _one_line_exit_2(capsys, [*train, *on, "partial.over_sample=1e9", "--print-config"],
                            "x (1 + partial.over_sample 1e+09) x grpo.group_size 4 = 1.6e+10 responses")
    assert ": error: partial.over_sample=1e9: " in line
    _one_line_exit_2(capsys, [*train, *on, "partial.over_sample=5"],
                     "data.jsonl: 20 usable prompts, fewer than the 24 groups a partial rollout launches")
    line = _one_line_exit_2(capsys, ["simulate", "--trace", _trace(tmp_path / "t.jsonl"), "partial.enabled=true",
                                     "partial.end=budget", "partial.token_budget=0", "--print-config"],
                            "end 'budget' needs a budget > 0, got 0")
    assert ": error: partial.token_budget=0: " in line


def test_yaml_duplicate_keys_aliases_long_values_and_yaml12_floats(cfg, tmp_path, capsys):
    text = cfg.read_text()
    dup = tmp_path / "dup.yaml"
    dup.write_text("optim:\n  lr: 0.1\n" + text + "optim:\n  lr: 0.2\n")
    line = _one_line_exit_2(capsys, ["train", "--config", dup, "--print-config"], f"{dup}:")
    assert "duplicate key 'optim' (first at line 1)" in line, line
    deep = tmp_path / "deep.yaml"
    deep.write_text(text + "warmstart:\n  lr: 0.1\n  sft_steps: 0\n  lr: 0.2\n")
    line = _one_line_exit_2(capsys, ["train", "--config", deep, "--print-config"], "duplicate key 'lr'")
    assert f"{deep}:{len(text.splitlines()) + 4}:" in line and "first at line" in line, line

    # 300 bytes of nested anchors: a billion-element value if anything expanded it.
    bomb = tmp_path / "bomb.yaml"
    levels = ['a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb.write_text("\n".join(levels) + "\nlogging:\n  tags: *a8\n")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    _one_line_exit_2(capsys, ["train", "--config", bomb, "--print-config"], "aliases")
    assert time.monotonic() - t0 < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 100_000  # KiB

    long = tmp_path / "long.yaml"
    long.write_text(text + f"dtype: {'x' * 100_000}\n")
    _one_line_exit_2(capsys, ["train", "--config", long, "--print-config"], "more characters")

    floats = tmp_path / "floats.yaml"
    floats.write_text(text + "optim:\n  lr: 1e-3\n  eps: 5E-9\n")
    assert main(["train", "--config", str(floats), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.001" in out and "eps: 5.0e-09" in out, out


def test_trace_lengths_beyond_any_model_and_deep_json_are_one_line(tmp_path, capsys):
    huge = _trace(tmp_path / "huge.jsonl", response_len=10**12)
    for argv in (["plan", "--trace", huge], ["predict", "--trace", huge],
                 ["simulate", "--trace", huge, "--ranks", "4", "--floor", "2"]):
        _one_line_exit_2(capsys, argv, f"{huge}:1: field 'response_len' is 1000000000000 tokens")
    deep = _trace(tmp_path / "deep.jsonl", extra="[" * 100_000 + "]" * 100_000)
    _one_line_exit_2(capsys, ["plan", "--trace", deep], f"{deep}:17: JSON nested too deeply")
    # A replayed rollout must not generate past the model's positions (it did, silently).
    _one_line_exit_2(capsys, ["rollout", "--trace", _trace(tmp_path / "long.jsonl", response_len=5000),
                              "--ranks", "2", "--length-scale", "1"], "beyond model.max_position_embeddings")


def test_a_half_set_torchrun_environment_is_refused_naming_what_is_missing(capsys, monkeypatch):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(var, value)
    _one_line_exit_2(capsys, ["rollout", "--ranks", "2", "--print-config"],
                     "torchrun environment half set", "MASTER_PORT, LOCAL_RANK not",
                     "unset RANK WORLD_SIZE MASTER_ADDR")


def test_overrides_after_flags_and_a_broken_stdout_pipe(tmp_path, capsys):
    trace = _trace(tmp_path / "t.jsonl")
    assert main(["plan", "--trace", str(trace), "alpha=0.1", "--ranks", "4", "seed=3", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "alpha: 0.1" in out and "seed: 3" in out and "ranks: 4" in out, out
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "plan", "--trace", str(trace)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
    proc.stdout.close()  # `| head -0`: the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 128 + signal.SIGPIPE and err == "", err


def test_a_rollout_into_a_folder_in_use_is_refused(tmp_path, capsys):
    from megatron_rl.cli.out_lock import hold_out_dir

    with hold_out_dir(tmp_path, "train"):
        _one_line_exit_2(capsys, ["rollout", "--ranks", "2", "--out", tmp_path, "--quiet"],
                         f"--out {tmp_path}: in use by pid {os.getpid()} (`flexfloor train`, started ")
    assert not (tmp_path / "config.yaml").exists()


def _train(cfg, out, *extra):
    assert main(["train", "--config", str(cfg), "--out", str(out), *map(str, extra)]) == 0


@pytest.mark.slow
def test_checkpoints_are_data_export_and_resume_step(cfg, tmp_path, capsys, monkeypatch):
    """One 2-step run, then: a tampered checkpoint never runs its payload; export and re-export
    (after a full disk) any step; --resume-step; a dataset without answers; a binary `latest`."""
    import hashlib
    import pickle
    import shutil

    from safetensors.torch import load_file

    out = tmp_path / "out"
    _train(cfg, out)
    trained = load_file(str(out / "hf" / "model.safetensors"))

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'marker'}",))

    evil = tmp_path / "evil"
    shutil.copytree(out, evil, ignore=shutil.ignore_patterns(".flexfloor.lock"))
    meta = evil / "checkpoints" / "step_000002" / ".metadata"
    meta.write_bytes(pickle.dumps(Payload()))
    sums = json.loads((meta.parent / "checksums.json").read_text())
    sums[".metadata"] = hashlib.sha256(meta.read_bytes()).hexdigest()
    (meta.parent / "checksums.json").write_text(json.dumps(sums))
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", evil, "--steps", "3"],
                     f"{meta}: refused: the file asks for posix.system")
    (meta.parent / "checksums.json").unlink()
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", evil, "--steps", "3"],
                     "checksums.json: missing", "--allow-unverified-checkpoint")
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", evil, "--steps", "3",
                              "--allow-unverified-checkpoint"], "refused: the file asks for posix.system")
    _one_line_exit_2(capsys, ["export", "--out", evil, "--allow-unverified-checkpoint"], "refused")
    assert not (tmp_path / "marker").exists()
    (evil / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00")
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", evil, "--steps", "3"], "latest: unreadable")

    # The export of the last step equals the trainer's own; a full disk keeps the previous export.
    def full_disk(*a, **k):
        raise OSError(28, "No space left on device", str(out / "hf.tmp" / "model.safetensors"))

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    _one_line_exit_2(capsys, ["export", "--out", out, "--step", "1"], "No space left on device",
                     "the previous export is unchanged", "flexfloor export --out")
    monkeypatch.undo()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert not (out / "hf.tmp").exists()
    again = load_file(str(out / "hf" / "model.safetensors"))
    assert again.keys() == trained.keys() and all((again[k] == trained[k]).all() for k in again)
    assert main(["export", "--out", str(out), "--to", str(tmp_path / "hf2")]) == 0
    exported = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert all((exported[k] == trained[k]).all() for k in trained)
    _one_line_exit_2(capsys, ["export", "--out", out, "--step", "7"],
                     "no checkpoint of step 7 (checkpoints of steps: 1, 2)")

    # --resume-step: step 2 again from step 1's checkpoint, the same weights (seeds are per step).
    capsys.readouterr()
    _train(cfg, out, "--resume-step", "1")
    assert f"resuming from {out / 'checkpoints' / 'step_000001'} (step 1)" in capsys.readouterr().err
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    redone = load_file(str(out / "hf" / "model.safetensors"))
    assert all((redone[k] == trained[k]).all() for k in trained)

    # A dataset with no reference answers would train at reward 0 on every response.
    data = tmp_path / "noanswer.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", tmp_path / "o2", f"data.path={data}"],
                     "no row has a reference answer")
