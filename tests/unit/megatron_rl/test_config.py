import pytest

from megatron_rl.config import load_dataclass
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.config import RolloutConfig
from tests.helpers import REPO


def write(tmp_path, text):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_defaults_are_the_tiny_example():

    example = REPO / "examples" / "tiny_cpu.yaml"
    assert load_dataclass(RolloutConfig, example) == RolloutConfig()


def test_unknown_key_names_file_and_field(tmp_path):
    p = write(tmp_path, "model:\n  num_layerz: 2\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml\.model: unknown field 'num_layerz'"):
        load_dataclass(RolloutConfig, p)


def test_wrong_type_names_field_and_expectation(tmp_path):
    p = write(tmp_path, "ranks: four\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml\.ranks: expected an integer, got 'four'"):
        load_dataclass(RolloutConfig, p)


def test_experts_not_divisible_by_ranks(tmp_path):
    p = write(tmp_path, "ranks: 3\n")
    with pytest.raises(ConfigError, match=r"num_moe_experts: expected a multiple of ranks \(3\), got 8"):
        load_dataclass(RolloutConfig, p)


def test_more_ranks_than_experts():
    with pytest.raises(ConfigError, match=r"ranks: expected at most 8 \(the model's experts"):
        load_dataclass(RolloutConfig, None, {"ranks": 16})


def test_literal_choices_listed(tmp_path):
    p = write(tmp_path, "policy: fastest\n")
    with pytest.raises(ConfigError, match=r"policy: expected one of 'vanilla', 'lengthsort'"):
        load_dataclass(RolloutConfig, p)


def test_cli_style_overrides():
    cfg = load_dataclass(RolloutConfig, None, {"ranks": 2, "batch.length_scale": 0.5})
    assert cfg.ranks == 2 and cfg.batch.length_scale == 0.5
