"""Checkpoint faults: state AdamW never created, corrupt or torn
files, a full disk; each is one line naming the file, and the last good checkpoint stays in force."""
import pytest
import torch

from elastic.trace import Trace
from megatron_rl.backends import backend
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.params import is_expert_param
from megatron_rl.rl.checkpoint.dcp import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_rl.rl.step_faults import TrainingDiverged, check_finite
from megatron_rl.rl.update.train_step import make_optimizer
from megatron_rl.trainer_config import TrainerConfig

CFG = TrainerConfig(model=MoEModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                         num_query_groups=1, kv_channels=8, num_moe_experts=4,
                                         moe_router_topk=1, moe_ffn_hidden_size=8, vocab_size=20),
                    ranks=1, prompts_per_step=1)


def _model_and_optimizer():
    model = backend(CFG.backend).training_model(CFG, 0, 1)
    return model, make_optimizer(model, 1e-2)


def _step_without_expert_3(model, opt):
    """An update in which expert 3 got no gradient, as when the router sent it no token."""
    for n, p in model.named_parameters():
        p.grad = None if (is_expert_param(n) and ".local_experts.3." in n) else torch.ones_like(p)
    opt.step()


def _save(out, step, model, opt):
    return save_checkpoint(out, step, model, opt, None, {"data": {}}, Trace([], "h"), 0)


@pytest.fixture
def saved(one_rank_group, tmp_path):
    model, opt = _model_and_optimizer()
    _step_without_expert_3(model, opt)
    return tmp_path, _save(tmp_path, 1, model, opt), model, opt


def test_resume_restores_exactly_the_state_the_optimizer_held(saved):
    _, path, model, opt = saved
    fresh, fresh_opt = _model_and_optimizer()
    load_checkpoint(path, fresh, fresh_opt, None)
    names = {id(p): n for n, p in model.named_parameters()}
    held = {names[id(p)]: s for p, s in opt.state.items()}
    fresh_names = {id(p): n for n, p in fresh.named_parameters()}
    loaded = {fresh_names[id(p)]: s for p, s in fresh_opt.state.items()}
    assert held.keys() == loaded.keys() and not any(".local_experts.3." in n for n in loaded)
    for n in held:
        for k in held[n]:
            assert torch.equal(torch.as_tensor(held[n][k]), torch.as_tensor(loaded[n][k])), (n, k)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n


def _flip(path, offset=200):
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_shard_is_refused_naming_the_file(saved):
    _, path, _, _ = saved
    shard = sorted(path.glob("*.distcp"))[0]
    _flip(shard)
    with pytest.raises(CheckpointError, match=f"^{shard}: checksum mismatch"):
        load_checkpoint(path, *_model_and_optimizer(), None)


def test_torn_shard_and_metadata_are_one_line_errors_naming_the_file(saved):
    _, path, _, _ = saved
    (path / "checksums.json").unlink()  # as a checkpoint written before checksums
    meta = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(meta[:100])
    with pytest.raises(CheckpointError, match=f"^{path / '.metadata'}: unreadable checkpoint metadata") as e:
        load_checkpoint(path, *_model_and_optimizer(), None, allow_unverified=True)
    assert "\n" not in str(e.value)
    (path / ".metadata").write_bytes(meta)
    shard = sorted(path.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=f"^{shard}: the metadata names bytes 0\\+") as e:
        load_checkpoint(path, *_model_and_optimizer(), None, allow_unverified=True)
    assert "\n" not in str(e.value)


def fill_the_disk(monkeypatch):
    """From now on every shard write fails with ENOSPC, as on a full disk."""
    import contextlib

    from torch.distributed.checkpoint.filesystem import FileSystem

    opened = FileSystem.create_stream

    @contextlib.contextmanager
    def full(self, path, mode):
        with opened(self, "/dev/full" if str(path).endswith(".distcp") else path, mode) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", full)


def test_a_full_disk_says_no_space_left_and_keeps_the_last_checkpoint(saved, monkeypatch):
    out, first, model, opt = saved
    target = out / "checkpoints" / "step_000002"
    fill_the_disk(monkeypatch)
    with pytest.raises(CheckpointError, match="No space left on device") as e:
        _save(out, 2, model, opt)
    assert str(e.value).startswith(str(target)) and "\n" not in str(e.value)
    assert latest_checkpoint(out) == first


def test_non_finite_loss_or_grad_stops_naming_the_step_and_the_last_good_checkpoint(saved):
    out, first, _, _ = saved
    check_finite(2, {"loss": 0.5, "grad_norm": 1.0}, out)
    for bad in ({"loss": float("nan"), "grad_norm": 1.0}, {"loss": 0.1, "grad_norm": float("inf")}):
        with pytest.raises(TrainingDiverged, match=f"^step 2: non-finite .*last good checkpoint: {first}"):
            check_finite(2, bad, out)


# ---- retention ----------------------------------------------------------------
def test_retention_keeps_the_newest_every_nth_and_steps_above_latest():
    from megatron_rl.rl.checkpoint.retention import kept_steps

    steps = list(range(1, 11))
    assert kept_steps(steps, 10, 3, 0) == {8, 9, 10}
    assert kept_steps(steps, 10, 3, 4) == {4, 8, 9, 10}
    assert kept_steps(steps, 10, 1, 0) == {10}
    assert kept_steps(steps, 5, 2, 0) == {4, 5, 6, 7, 8, 9, 10}  # after --resume-step 5: later ones stay
    assert kept_steps([2, 7], 7, 5, 3) == {2, 7}


def test_saves_remove_old_checkpoints_only_after_latest_moves_and_a_crash_never_strands_latest(saved, monkeypatch):
    import shutil

    from megatron_rl.rl.checkpoint import retention

    out, _, model, opt = saved
    root = out / "checkpoints"
    (root / "step_000000").symlink_to(root / "step_000001")  # a link is the user's: never removed
    for step in (2, 3, 4):
        state = {"data": {}}
        save_checkpoint(out, step, model, opt, None, state, Trace([], "h"), 0, keep=(2, 0))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000000", "step_000003", "step_000004"]

    real_rmtree = shutil.rmtree

    def dies_half_way(path, *a, **k):  # the removal is cut short (a kill, an I/O error)
        next(p for p in sorted(path.iterdir()) if p.is_file()).unlink()
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(retention.shutil, "rmtree", dies_half_way)
    save_checkpoint(out, 5, model, opt, None, {"data": {}}, Trace([], "h"), 0, keep=(2, 0))
    assert latest_checkpoint(out) == root / "step_000005"
    load_checkpoint(latest_checkpoint(out), *_model_and_optimizer(), None)  # latest is whole
    assert (root / ".deleting-step_000003").is_dir() and not (root / "step_000003").exists()
    monkeypatch.setattr(retention.shutil, "rmtree", real_rmtree)
    save_checkpoint(out, 6, model, opt, None, {"data": {}}, Trace([], "h"), 0, keep=(2, 0))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000000", "step_000005", "step_000006"]


def test_a_save_that_cannot_fit_is_refused_at_start(tmp_path, monkeypatch, capsys):
    import collections
    from dataclasses import replace

    from megatron_rl.rl.checkpoint import retention
    from megatron_rl.rl.checkpoint.retention import check_room, save_bytes

    cfg = replace(CFG, dtype="bfloat16")
    n = sum(p.numel() for p in backend(CFG.backend).training_model(CFG, 0, 1).parameters())
    assert save_bytes(cfg) == n * 14  # bf16 weights, fp32 masters and two fp32 moments
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(retention.shutil, "disk_usage", lambda p: usage(0, 0, 10**12))
    check_room(cfg, tmp_path / "run")
    err = capsys.readouterr().err
    assert f"about {n * 14 / 1e9:.3g} GB a save, keep_last 3" in err and f"1e+03 GB free in {tmp_path}" in err
    monkeypatch.setattr(retention.shutil, "disk_usage", lambda p: usage(0, 0, n))
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'run' / 'checkpoints'}: a checkpoint takes about"):
        check_room(cfg, tmp_path / "run")
