"""`checkpoint.async_save` writes in the background, but `latest` moves only once
the checksums are complete and verified; the written state is the one at save time (the next step
may already change the weights); a failed write is the synchronous path's one line, and `latest`
stays on the previous checkpoint."""
import threading

import pytest
import torch
import torch.distributed.checkpoint

from elastic.trace import Trace
from megatron_rl.rl.checkpoint import checksums
from megatron_rl.rl.checkpoint.async_save import CheckpointWriter
from megatron_rl.rl.checkpoint.dcp import CheckpointError, latest_checkpoint, load_checkpoint

from .test_faults import _model_and_optimizer, _step_without_expert_3, fill_the_disk


def _save(writer, step, model, opt):
    writer.save(step, model, opt, None, {"data": {}}, Trace([], "h"))


@pytest.fixture
def saved_once(one_rank_group, tmp_path):
    """A model, its optimizer and a background writer into tmp_path (rank 0, keep_last 1) that
    has saved them as step 1."""
    model, opt = _model_and_optimizer()
    writer = CheckpointWriter(True, tmp_path, 0, (1, 0))
    _save(writer, 1, model, opt)
    writer.wait()
    return model, opt, writer


def test_latest_moves_only_after_the_checksums_and_the_saved_state_is_the_one_at_save_time(
        saved_once, tmp_path, monkeypatch):
    model, opt, writer = saved_once
    first = tmp_path / "checkpoints" / "step_000001"
    assert latest_checkpoint(tmp_path) == first
    _step_without_expert_3(model, opt)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    gates = {name: (threading.Event(), threading.Event()) for name in ("write", "hash")}

    def held(name, real):  # a slow disk: the writer has reached `name` and waits there
        def call(*args, **kwargs):
            reached, release = gates[name]
            reached.set()
            release.wait(60)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(torch.distributed.checkpoint, "save", held("write", torch.distributed.checkpoint.save))
    monkeypatch.setattr(checksums, "write_checksums", held("hash", checksums.write_checksums))
    _save(writer, 2, model, opt)
    second = tmp_path / "checkpoints" / "step_000002"
    assert gates["write"][0].wait(60), "the writer never started"
    with torch.no_grad():  # the next step runs while the shards are written
        for p in model.parameters():
            p.add_(1.0)
    gates["write"][1].set()
    assert gates["hash"][0].wait(60), "the writer never reached the checksums"
    assert latest_checkpoint(tmp_path) == first and not (second / "checksums.json").exists()
    gates["hash"][1].set()
    writer.wait()
    assert latest_checkpoint(tmp_path) == second
    assert not first.exists(), "retention (keep_last 1) runs once the newer checkpoint is verified"
    fresh, fresh_opt = _model_and_optimizer()
    load_checkpoint(second, fresh, fresh_opt, None)
    assert all(torch.equal(v, at_save[k]) for k, v in fresh.state_dict().items())


def test_a_failed_background_write_is_the_synchronous_one_line_and_latest_stays(
        saved_once, tmp_path, monkeypatch):
    model, opt, writer = saved_once
    fill_the_disk(monkeypatch)
    _save(writer, 2, model, opt)
    with pytest.raises(CheckpointError, match="No space left on device") as e:
        writer.wait()
    target = tmp_path / "checkpoints" / "step_000002"
    assert str(e.value).startswith(f"{target}: cannot write the checkpoint") and "\n" not in str(e.value)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000001"
    writer.wait()  # the failure is raised once; nothing is pending after it


def test_async_save_must_be_a_boolean():
    from megatron_rl.config import ConfigError
    from megatron_rl.trainer_config import CheckpointConfig

    with pytest.raises(ConfigError, match=r"^checkpoint.async_save: expected true or false, got 'yes'$"):
        CheckpointConfig(async_save="yes")
