"""Issue 23: inputs that cannot work are one line and exit 2 before any rank starts; the CLI as a
user types it, in process (`megatron_rl.cli.main`), so each case costs a config read, not a run."""
import json
import os
import resource
import signal
import time

import pytest

from megatron_rl.cli import main
from tests.process_tree import one_line_exit_2 as _one_line_exit_2
from tests.tiny_train import rehash as _rehash
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
    ("train", "generation.max_response_len=4096", "expected below model.max_position_embeddings"),
    ("train", "grpo.group_size=1000000", "grpo.group_size 1000000 = 4e+06 responses per rollout, above the "
                                          "limit of 2^20"),
    ("train", "partial.over_sample=-1", "partial.over_sample: expected a number >= 0"),  # also when off
    ("train", "partial.token_budget=-1", "partial.token_budget: only read with end 'budget'"),
    ("rollout", "max_batch_per_rank=0", "max_batch_per_rank: expected > 0"),
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


def test_overrides_after_flags(tmp_path, capsys):
    trace = _trace(tmp_path / "t.jsonl")
    assert main(["plan", "--trace", str(trace), "alpha=0.1", "--ranks", "4", "seed=3", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "alpha: 0.1" in out and "seed: 3" in out and "ranks: 4" in out, out


def test_a_rollout_into_a_folder_in_use_is_refused(tmp_path, capsys):
    from megatron_rl.out_lock import hold_out_dir

    with hold_out_dir(tmp_path, "train"):
        _one_line_exit_2(capsys, ["rollout", "--ranks", "2", "--out", tmp_path, "--quiet"],
                         f"--out {tmp_path}: in use by pid {os.getpid()} (`flexfloor train`, started ")
    assert not (tmp_path / "config.yaml").exists()


@pytest.mark.slow
def test_checkpoints_are_data_export_and_resume_step(cfg, tmp_path, capsys, monkeypatch):
    """One 2-step run, then: a tampered checkpoint never runs its payload; export and re-export
    (after a full disk) any step; --resume-step; a dataset without answers; a binary `latest`."""
    import hashlib
    import pickle
    import shutil

    from safetensors.torch import load_file

    out = tmp_path / "out"
    assert main(["train", "--config", str(cfg), "--out", str(out)]) == 0
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
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", evil, "--steps", "3"],
                     "latest: expected a name such as step_000010, got an unreadable file")

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
    assert main(["train", "--config", str(cfg), "--out", str(out), "--resume-step", "1"]) == 0
    assert f"resuming from {out / 'checkpoints' / 'step_000001'} (step 1)" in capsys.readouterr().err
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    redone = load_file(str(out / "hf" / "model.safetensors"))
    assert all((redone[k] == trained[k]).all() for k in trained)

    # A dataset with no reference answers would train at reward 0 on every response.
    data = tmp_path / "noanswer.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", tmp_path / "o2", f"data.path={data}"],
                     "no row has a reference answer")


# ---- issue 31: `export --to` replaces only what FlexFloor owns; reads stay inside the checkpoint ----
@pytest.fixture
def run_folder(one_rank_group, tmp_path):
    from tests.tiny_train import tiny_run_folder

    return tiny_run_folder(tmp_path)


def _listing(out):
    return sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def test_export_to_the_run_itself_or_what_holds_it_is_refused_and_deletes_nothing(run_folder, tmp_path, capsys,
                                                                                 monkeypatch):
    out = run_folder
    before = _listing(tmp_path)
    for to, expect in ((out, "is --out"), (tmp_path, "is --out"), (out / "checkpoints", "is inside --out"),
                       (out / "checkpoints" / "step_000001", "is inside --out"), (out / "new", "is inside --out")):
        _one_line_exit_2(capsys, ["export", "--out", out, "--to", to], f"--to {to}: {expect}")
    monkeypatch.chdir(tmp_path)
    for to in (".", "/", ".."):
        _one_line_exit_2(capsys, ["export", "--out", out, "--to", to], f"--to {to}: not a folder an export")
    _one_line_exit_2(capsys, ["export", "--out", out, "--to", tmp_path / ("x" * 300)],
                     "a path component is 300 bytes long")
    assert _listing(tmp_path) == before


def test_export_to_a_folder_or_file_it_did_not_write_is_refused(run_folder, tmp_path, capsys):
    out = run_folder
    theirs = tmp_path / "base-model"
    theirs.mkdir()
    (theirs / "config.json").write_text("{}")
    _one_line_exit_2(capsys, ["export", "--out", out, "--to", theirs], "not a FlexFloor export")
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    _one_line_exit_2(capsys, ["export", "--out", out, "--to", afile], "is an existing file")
    link = tmp_path / "link"
    link.symlink_to(theirs)
    _one_line_exit_2(capsys, ["export", "--out", out, "--to", link], "is a symlink")
    assert (theirs / "config.json").read_text() == "{}" and afile.read_text() == "mine"

    # An empty folder, then the export it became, may be written; the user's .old/.tmp never go.
    ours = tmp_path / "hf-empty"
    ours.mkdir()
    for leftover in ("hf-empty.old", "hf-empty.tmp"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "keep").write_text("user data")
    for _ in range(2):
        assert main(["export", "--out", str(out), "--to", str(ours)]) == 0
    assert (ours / ".flexfloor-export").is_file() and (ours / "config.json").is_file()
    assert all((tmp_path / n / "keep").read_text() == "user data" for n in ("hf-empty.old", "hf-empty.tmp"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf-empty")]  # no temporaries left


def test_export_refuses_while_a_train_holds_the_run_or_the_target_run(run_folder, tmp_path, capsys):
    from megatron_rl.out_lock import hold_out_dir
    from tests.tiny_train import tiny_run_folder

    out = run_folder
    with hold_out_dir(out, "train"):
        _one_line_exit_2(capsys, ["export", "--out", out], f"--out {out}: in use by pid {os.getpid()}")
    other = tiny_run_folder(tmp_path / "b", steps=(1,))
    _one_line_exit_2(capsys, ["export", "--out", out, "--to", other / "checkpoints"], "inside the run folder")
    with hold_out_dir(other, "train"):
        _one_line_exit_2(capsys, ["export", "--out", out, "--to", other / "hf"], f"--to {other}: in use by")
    assert not (other / "hf").exists() and not (out / "hf").exists()



def _with_storage(path, relative_path):
    """Rewrite step `path`'s metadata so its first tensor is read from `relative_path`, checksums
    rewritten to match (what someone who can write the folder can do)."""
    import pickle

    from megatron_rl.rl.checkpoint_trust import read_metadata

    meta = read_metadata(path)
    first = next(iter(meta.storage_data))
    meta.storage_data[first].relative_path = relative_path
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    _rehash(path, ".metadata")


@pytest.mark.parametrize("where", ["../step_000001/__0_0.distcp", "/etc/passwd", "/dev/zero", "extra.distcp",
                                   "fifo.distcp"])
def test_export_reads_nothing_outside_the_checkpoint_or_unlisted(run_folder, capsys, where):
    step = run_folder / "checkpoints" / "step_000002"
    if where == "extra.distcp":
        (step / where).write_bytes((step / "__0_0.distcp").read_bytes())
    if where == "fifo.distcp":
        os.mkfifo(step / where)
        sums = json.loads((step / "checksums.json").read_text())
        (step / "checksums.json").write_text(json.dumps({**sums, where: "0" * 64}))
    _with_storage(step, where)
    def hung(*a):
        raise TimeoutError("the export hung")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)  # a FIFO hung the export forever
    try:
        line = _one_line_exit_2(capsys, ["export", "--out", run_folder], str(step))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert ("not a file of the checkpoint" in line if "/" in where else
            "does not list" in line if where == "extra.distcp" else "is a FIFO, not a regular file" in line), line
    assert not (run_folder / "hf").exists()


def test_export_checks_the_sidecars_and_metadata_before_parsing_them(run_folder, tmp_path, capsys):
    import pickle
    import shutil

    step = run_folder / "checkpoints" / "step_000002"
    good = {n: (step / n).read_bytes() for n in (".metadata", "trainer_state.json", "checksums.json")}

    def reset():
        for n, b in good.items():
            (step / n).unlink()
            (step / n).write_bytes(b)

    state = json.loads(good["trainer_state.json"])
    cases = [  # (file, new bytes, rehash, the line names)
        ("trainer_state.json", json.dumps({**state, "model": {**state["model"], "num_layers": 200000}}).encode(),
         True, "(200000 layers) implies 3000003 weight tensors; the shards hold 18"),
        ("trainer_state.json", json.dumps({**state, "step": 3}).encode(), False, "checksum mismatch"),
        (".metadata", good[".metadata"][:100], True, "unreadable checkpoint metadata"),
        (".metadata", b"", True, "unreadable checkpoint metadata"),
        (".metadata", pickle.dumps({"not": "metadata"}), True, "holds a dict, not DCP metadata"),
        (".metadata", b"\x80\x02K\x01Q.", True, "unreadable checkpoint metadata (UnpicklingError"),  # PERSID
        (".metadata", b"\x80\x02\x82\x01.", True, "unreadable checkpoint metadata"),  # EXT1
        ("checksums.json", b"[" * 100_000 + b"]" * 100_000, False, "nested deeper than 64 levels"),
        ("trainer_state.json", b'{"a":' * 1000 + b"1" + b"}" * 1000, True, "nested deeper than 64 levels"),
    ]
    for name, data, rehash, expect in cases:
        (step / name).write_bytes(data)
        if rehash:
            _rehash(step, name)
        line = _one_line_exit_2(capsys, ["export", "--out", run_folder], f"{step / name}", expect)
        assert "\n" not in line
        reset()
    for name in (".metadata", "trainer_state.json"):  # a symlink loop, /dev/zero: never opened
        (step / name).unlink()
        (step / name).symlink_to(step / name)
        _one_line_exit_2(capsys, ["export", "--out", run_folder], f"{step / name}: is a symlink")
        (step / name).unlink()
        (step / name).symlink_to("/dev/zero")
        _one_line_exit_2(capsys, ["export", "--out", run_folder], f"{step / name}: is a symlink")
        reset()
    shutil.copy(step / "trainer_state.json", tmp_path / "s")
    (step / "trainer_state.json").write_bytes(b" " * (1 << 24) + good["trainer_state.json"])
    _one_line_exit_2(capsys, ["export", "--out", run_folder], "more than the 16777216")
    reset()
    assert main(["export", "--out", str(run_folder)]) == 0


def test_resume_step_moves_latest_before_anything_is_truncated(run_folder, tmp_path, capsys, monkeypatch):
    """Issue 31 defect 5: a crash after `--resume-step 1` truncated metrics.jsonl left `latest` on
    step 2, whose metrics line was then gone for good. The ranks are replaced by a crash."""
    from megatron_rl.errors import FlexFloorError
    from megatron_rl.metrics import _drop_steps_after
    from tests.tiny_train import tiny_train_config

    def crash(*a, **k):
        raise FlexFloorError("the node died")

    monkeypatch.setattr("megatron_rl.train_driver.run_ranks", crash)
    cfg = tiny_train_config(tmp_path, steps=3)
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", run_folder, "--resume-step", "1"], "the node died")
    assert (run_folder / "checkpoints" / "latest").read_text() == "step_000001"
    metrics = run_folder / "metrics.jsonl"

    def torn(*a):  # the rewrite dies before its rename: the old file stays whole
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("os.fsync", torn)
    with pytest.raises(OSError):
        _drop_steps_after(metrics, 1)
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
    monkeypatch.undo()
    _drop_steps_after(metrics, 1)
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1]
    assert not [p for p in run_folder.iterdir() if ".tmp" in p.name]


def test_a_refused_train_leaves_nothing_in_a_folder_it_created(cfg, tmp_path, capsys):
    """Issue 31 defect 28: --out/checkpoints/ and .flexfloor.lock stayed behind."""
    data = tmp_path / "noanswer.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    new, refused = tmp_path / "new" / "run", "no row has a reference answer"
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", new, f"data.path={data}"], refused)
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    _one_line_exit_2(capsys, ["train", "--config", cfg, "--out", mine, f"data.path={data}"], refused)
    assert _listing(mine) == ["notes.txt"]
