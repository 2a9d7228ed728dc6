"""Issue 23 items 6 and 12: weights that overflow the run's dtype, and the run folder's own files
(trainer_state.json, latest, wandb_run.json) when corrupt: each one line naming the file."""
import json

import pytest
import torch

from megatron_rl.errors import FlexFloorError
from megatron_rl.models import MoEModelConfig, Qwen3MoeModel, load_hf_checkpoint, save_hf_checkpoint
from megatron_rl.rl.checkpoint import CheckpointError, latest_checkpoint, read_state_json

TINY = MoEModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                      kv_channels=8, num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=8, vocab_size=20)


def test_a_weight_that_overflows_the_run_dtype_is_named_after_the_cast(tmp_path):
    model = Qwen3MoeModel(TINY, dtype=torch.float64)
    model.init_weights(0)
    name, param = next((n, p) for n, p in model.named_parameters() if "linear_qkv" in n)
    with torch.no_grad():
        param[0, 0] = 1e300  # finite in float64, inf in float32
    save_hf_checkpoint(model, tmp_path / "ckpt")
    assert load_hf_checkpoint(tmp_path / "ckpt", torch.float64) is not None
    from megatron_rl.models.hf import CheckpointError as HFCheckpointError

    with pytest.raises(HFCheckpointError, match=r"holds 1 value\(s\) \(largest 1e\+300\) that overflow float32 "
                                              r"\(max 3.4e\+38\)"):
        load_hf_checkpoint(tmp_path / "ckpt", torch.float32)


@pytest.mark.parametrize("content", [b"\xff\xfe", b"[1, 2]", b'{"step": "3", "model": {}, "data": {}}',
                                     b"[" * 100_000, b'{"step": 1}'])
def test_a_corrupt_trainer_state_is_one_line(tmp_path, content):
    (tmp_path / "trainer_state.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'trainer_state.json'}: ") as e:
        read_state_json(tmp_path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize("content", [b"\xff\x00\x01", b"../../etc", b"step_1 rm -rf"])
def test_a_latest_pointer_that_names_no_step_is_one_line(tmp_path, content):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match="latest: ") as e:
        latest_checkpoint(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content", [b"\xff", b"[]", b'{"id": 3}', b"{" * 50_000])
def test_a_bad_wandb_run_json_is_one_line(tmp_path, content):
    from megatron_rl.metrics import read_run_state

    (tmp_path / "wandb_run.json").write_bytes(content)
    with pytest.raises(FlexFloorError, match="wandb_run.json: unreadable"):
        read_run_state(tmp_path / "wandb_run.json")
    (tmp_path / "wandb_run.json").write_text(json.dumps({"id": "ab12", "last_step": 3}))
    assert read_run_state(tmp_path / "wandb_run.json") == {"id": "ab12", "last_step": 3}
