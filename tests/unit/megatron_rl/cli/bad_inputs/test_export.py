"""`flexfloor export`: a checkpoint is data. Tampered, torn or out-of-place checkpoint files, and
`--to` folders it does not own, are one line naming the file, exit 2; nothing outside the
checkpoint is read and nothing it did not write is replaced."""
import json
import os
import signal

import pytest

from megatron_rl.cli import main
from tests.helpers.cli import listing as _listing
from tests.process_tree import one_line_exit_2 as _one_line_exit_2
from tests.tiny_train import rehash as _rehash


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


def test_export_flags_are_checked_before_anything_is_read(files, refuses_each):
    """--shard-gb 0 was silently ignored, -1 wrote a shard per tensor, 1e300, nan and inf were
    tracebacks; --step -1 named a folder step_-00001."""
    out = files.out
    shard_gb = [(["--out", out, f"--shard-gb={gb}"], [f"--shard-gb {gb}: expected a positive finite number"])
                for gb in ("0", "-1", "nan", "inf", "-inf")]
    refuses_each("export", [*shard_gb, (["--out", out, "--step=-1"], ["--step -1: expected a step >= 0"])])


def test_a_shard_bound_past_any_model_is_one_shard_and_below_a_byte_a_shard_per_tensor():
    from megatron_rl.commands.export import shard_size

    assert shard_size(5) == 5 * 10**9 and shard_size(1e300) >= 2**62 and shard_size(1e-300) == 1


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
    from megatron_rl.files.out_lock import hold_out_dir
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

    from megatron_rl.rl.checkpoint.trust import read_metadata

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
