"""Device and process-group selection, and the one-line refusal of `device: cuda` without CUDA."""
import os

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.config import load_dataclass
from megatron_rl.errors import ConfigError, FlexFloorError
from megatron_rl.parallel import launch
from megatron_rl.parallel.device import dist_backend, rank_device, resolve_device
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.trainer_config import TrainerConfig
from tests.helpers import REPO


def fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_follows_cuda_availability(monkeypatch):
    fake_gpus(monkeypatch, 0)
    assert resolve_device("auto") == "cpu"
    fake_gpus(monkeypatch, 8)
    assert resolve_device("auto") == "cuda" and resolve_device("cpu") == "cpu"


def test_cuda_without_cuda_is_one_line(monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(FlexFloorError, match=r"^device: 'cuda' but no CUDA device is visible .*use device: cpu"):
        resolve_device("cuda")


@pytest.mark.parametrize("command", [["rollout", "--quiet"], ["train", "--config", "examples/tiny_cpu_grpo.yaml"]])
def test_cli_refuses_cuda_without_cuda_with_exit_2(monkeypatch, capsys, command, tmp_path):
    fake_gpus(monkeypatch, 0)
    monkeypatch.chdir(REPO)
    assert main([*command, "--device", "cuda", *(["--out", str(tmp_path)] if command[0] == "train" else [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device is visible" in err[0]


def test_backend_per_device_and_transport():
    assert dist_backend("cpu") == "gloo" and dist_backend("cuda") == "nccl"
    assert dist_backend("cuda", "host") == "gloo"  # ranks sharing a GPU cannot use NCCL


def test_one_gpu_per_rank_from_local_rank(monkeypatch):
    fake_gpus(monkeypatch, 8)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert rank_device("cuda", 13) == torch.device("cuda", 5)  # the node-local GPU, not the global rank
    monkeypatch.delenv("LOCAL_RANK")
    assert rank_device("cuda", 3) == torch.device("cuda", 3) and rank_device("cpu", 3) == torch.device("cpu")
    fake_gpus(monkeypatch, 1)
    with pytest.raises(FlexFloorError, match="rank 1 .* has no GPU of its own: 1 visible"):
        rank_device("cuda", 1)
    assert rank_device("cuda", 1, "host") == torch.device("cuda", 0)


def test_nccl_init_sets_the_device_first_and_passes_device_id(monkeypatch):
    fake_gpus(monkeypatch, 8)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(launch.dist, "init_process_group",
                        lambda backend, **kw: calls.append((backend, kw["device_id"], kw["timeout"].seconds)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    assert launch._init(10, 16, 1800.0, "cuda", "direct") == torch.device("cuda", 2)
    assert calls == [("set_device", torch.device("cuda", 2)), ("nccl", torch.device("cuda", 2), 1800)]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    calls.clear()
    monkeypatch.setattr(launch.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    launch._init(0, 2, 60.0, "cpu", "direct")
    assert calls[0][0] == "gloo" and "device_id" not in calls[0][1]


@pytest.mark.parametrize("cls, field", [(RolloutConfig, "device"), (TrainerConfig, "device"),
                                        (RolloutConfig, "transport")])
def test_config_fields_validated(cls, field):
    with pytest.raises(ConfigError, match=f"{field}=tpu: {field}: expected one of"):
        load_dataclass(cls, None, {field: "tpu"})


def test_kv_memory_fraction_bounds():
    with pytest.raises(ConfigError, match=r"kv_memory_fraction: expected in \(0, 1\]"):
        load_dataclass(RolloutConfig, None, {"kv_memory_fraction": 1.5})


def test_rollout_help_says_how_gpus_run(capsys):
    with pytest.raises(SystemExit) as info:
        main(["rollout", "--config", "examples/qwen3_30b_a3b_16xh100.yaml", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0
    assert "one rank per GPU (cuda:LOCAL_RANK) over NCCL, e.g. 8 ranks per node" in out and "--device" in out
