"""A checkpoint is data. A pickle in `.metadata` or in a shard's byte entries that
asks for code is refused, naming the file and the global, and never runs, whether checksums.json
was updated to match it, removed, or left stale; a checkpoint without checksums needs a flag."""
import json
import os
import pickle

import pytest
import torch

from megatron_rl.rl.checkpoint.checksums import verify_checksums
from megatron_rl.rl.checkpoint.dcp import CheckpointError, load_checkpoint
from megatron_rl.rl.checkpoint.trust import UntrustedCheckpoint, read_metadata
from tests.tiny_train import rehash as _rehash

from .test_faults import _model_and_optimizer, _save, _step_without_expert_3


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def saved(one_rank_group, tmp_path):
    model, opt = _model_and_optimizer()
    _step_without_expert_3(model, opt)
    return _save(tmp_path / "run", 1, model, opt)



@pytest.mark.parametrize("checksums", ["updated", "removed", "stale"])
def test_a_metadata_pickle_that_runs_a_command_never_runs(saved, tmp_path, checksums):
    marker = tmp_path / "marker"
    (saved / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    if checksums == "updated":
        _rehash(saved, ".metadata")
    elif checksums == "removed":
        (saved / "checksums.json").unlink()
    for allow in (False, True):  # the flag lifts the checksum requirement, never the unpickler's
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(saved, *_model_and_optimizer(), None, allow_unverified=allow)
        assert "\n" not in str(e.value) and not marker.exists()
    if checksums == "updated":
        assert str(e.value) == (f"{saved / '.metadata'}: refused: the file asks for posix.system, which "
                                "checkpoint metadata never holds (the checkpoint is corrupt or was "
                                "tampered with); nothing from it was run")


def test_a_shard_byte_entry_that_runs_a_command_never_runs(saved, tmp_path):
    """DCP keeps non-tensor values (the optimizer's lr, betas) as torch.save blobs inside the shard,
    which torch itself loads with weights_only=False."""
    marker = tmp_path / "marker"
    meta = read_metadata(saved)
    shard = next(saved.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    for info in meta.storage_data.values():
        blob = data[info.offset: info.offset + info.length]
        if b"PK" in blob[:4] and info.length < 2000:  # a torch.save zip of a plain value
            import io
            buf = io.BytesIO()
            torch.save(_Payload(marker), buf)
            evil = buf.getvalue()
            data[info.offset: info.offset + info.length] = evil
            info.length = len(evil)
            shard.write_bytes(bytes(data))
            (saved / ".metadata").write_bytes(pickle.dumps(meta))
            break
    else:
        pytest.fail("no byte entry found in the shard")
    _rehash(saved, shard.name)
    _rehash(saved, ".metadata")
    with pytest.raises(CheckpointError, match="cannot load the checkpoint shards") as e:
        load_checkpoint(saved, *_model_and_optimizer(), None)
    assert "\n" not in str(e.value) and not marker.exists()


def test_a_checkpoint_without_checksums_needs_the_flag(saved):
    (saved / "checksums.json").unlink()
    with pytest.raises(CheckpointError, match="checksums.json: missing.*--allow-unverified-checkpoint"):
        load_checkpoint(saved, *_model_and_optimizer(), None)
    load_checkpoint(saved, *_model_and_optimizer(), None, allow_unverified=True)


def test_a_file_the_checksums_do_not_cover_is_refused(saved):
    sums = json.loads((saved / "checksums.json").read_text())
    good = sums.pop(".metadata")
    (saved / "checksums.json").write_text(json.dumps(sums))
    with pytest.raises(CheckpointError, match=r"\.metadata: not covered by .*checkpoint.allow_unverified=true"):
        verify_checksums(saved)
    verify_checksums(saved, allow_unverified=True)  # explicit trust: a checkpoint older than the listing
    sums["../../etc/passwd"] = "0" * 64
    sums[".metadata"] = good
    (saved / "checksums.json").write_text(json.dumps(sums))
    with pytest.raises(CheckpointError, match="which is not a file of the checkpoint"):
        verify_checksums(saved)


def test_the_real_metadata_reads_through_the_restricted_unpickler(saved):
    assert read_metadata(saved).state_dict_metadata  # every class a real checkpoint uses is allowed
    with pytest.raises(UntrustedCheckpoint):
        (saved / ".metadata").write_bytes(pickle.dumps(torch.nn.Linear(1, 1)))
        read_metadata(saved)


@pytest.mark.parametrize("name", ["Enum", "__class__", "Any", "Sequence"])
def test_the_allow_list_admits_no_class_factory_or_module_type(saved, name):
    """The metadata module's namespace also holds Enum (whose functional API
    makes classes) and, through `__class__`, types.ModuleType."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    module = dcp_metadata.__name__.encode()
    (saved / ".metadata").write_bytes(b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c"
                                      + bytes([len(name)]) + name.encode() + b"\x93.")  # STACK_GLOBAL
    _rehash(saved, ".metadata")
    with pytest.raises(UntrustedCheckpoint, match=f"asks for {dcp_metadata.__name__}.{name}"):
        read_metadata(saved)


@pytest.mark.parametrize("planted", ["step", "file", "latest"])
def test_a_save_never_follows_a_symlink_out_of_the_checkpoints_folder(one_rank_group, tmp_path, planted):
    """A planted `checkpoints/step_000002 -> elsewhere` wrote the checkpoint there."""
    model, opt = _model_and_optimizer()
    first = _save(tmp_path / "run", 1, model, opt)
    root, elsewhere = first.parent, tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = {"step": root / "step_000002", "file": root / "step_000002" / "__0_0.distcp",
            "latest": root / "latest"}[planted]
    if planted == "file":
        link.parent.mkdir()
    else:
        link.unlink(missing_ok=True)
    link.symlink_to(elsewhere / "x" if planted != "step" else elsewhere)
    with pytest.raises(CheckpointError, match=f"^{link}: a symlink to {elsewhere}.*outside {root}"):
        _save(tmp_path / "run", 2, model, opt)
    assert not list(elsewhere.iterdir())
    if planted != "latest":
        assert (root / "latest").read_text() == "step_000001"
    link.unlink()
    inside = root / "step_000003"  # a link that stays inside the folder is the user's business
    inside.symlink_to(first)
    assert _save(tmp_path / "run", 3, model, opt) == inside
