
import pytest

from megatron_rl.config import load_dataclass
from megatron_rl.errors import ConfigError
from megatron_rl.trainer_config import TrainerConfig
from tests.helpers import REPO

EXAMPLES = REPO / "examples"


def test_tiny_example_validates():
    cfg = load_dataclass(TrainerConfig, EXAMPLES / "tiny_cpu_grpo.yaml")
    assert cfg.ranks == 4 and cfg.tokenizer.kind == "char" and cfg.rows_per_rank == 32


def test_qwen3_30b_example_validates_through_the_same_dataclasses():
    cfg = load_dataclass(TrainerConfig, EXAMPLES / "qwen3_30b_a3b_16xh100.yaml")
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_moe_experts, m.moe_router_topk) == (48, 2048, 128, 8)
    assert cfg.ranks == 16 and cfg.dtype == "bfloat16" and cfg.elastic.policy == "planned"
    assert cfg.model.num_moe_experts % cfg.ranks == 0 and cfg.reward.kind == "math"


@pytest.mark.parametrize("override, message", [
    ({"ranks": 3}, "experts divide over the ranks"),
    ({"prompts_per_step": 3}, "expected a multiple of ranks x grpo.minibatches"),
    ({"grpo.group_size": 1}, "grpo.group_size: expected >= 2"),
    ({"model.vocab_size": 10}, "expected at least the character tokenizer's"),
    ({"elastic.policy": "fastest"}, "elastic.policy: expected one of"),
    ({"grpo.clip_lo": 0.1}, "unknown field 'clip_lo'"),
])
def test_mistakes_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_dataclass(TrainerConfig, EXAMPLES / "tiny_cpu_grpo.yaml", override)


def test_init_checkpoint_of_another_shape_is_refused(tmp_path):
    from megatron_rl.errors import FlexFloorError
    from megatron_rl.models import Qwen3MoeModel, save_hf_checkpoint
    from megatron_rl.rl.model_setup import check_init

    cfg = load_dataclass(TrainerConfig, EXAMPLES / "tiny_cpu_grpo.yaml")
    model = Qwen3MoeModel(cfg.model)
    save_hf_checkpoint(model, tmp_path / "same")
    check_init(load_dataclass(TrainerConfig, EXAMPLES / "tiny_cpu_grpo.yaml", {"init": str(tmp_path / "same")}))
    other = load_dataclass(TrainerConfig, EXAMPLES / "tiny_cpu_grpo.yaml",
                           {"init": str(tmp_path / "same"), "model.hidden_size": 32})
    with pytest.raises(FlexFloorError, match="another model shape.*hidden_size: checkpoint 64, config 32"):
        check_init(other)


@pytest.mark.parametrize("project, tags", [
    ("p" * 128, ["t" * 64]), ("p" * 129, []), ("a/b", []), ("a\\b", []), ("a#b", []), ("a?b", []), ("a%b", []),
    ("a:b", []), ("ok", [""]), ("ok", ["fine", "t" * 65]), ("ok-project_1.x", ["policy:planned", "floor:2"]),
])
def test_wandb_names_follow_wandbs_own_rules_at_config_load(project, tags):
    """The names W&B's settings refuse are refused at config load (one line
    naming the field), and the names it takes are taken: the same verdict as wandb's validators."""
    wandb = pytest.importorskip("wandb")
    from megatron_rl.metrics.wandb_run import LoggingConfig

    try:
        wandb.Settings(project=project, run_tags=tuple(tags))
        theirs = None
    except Exception as e:  # noqa: BLE001  (UsageError or pydantic's ValidationError)
        theirs = e
    if theirs is None:
        LoggingConfig(project=project, tags=tags)
    else:
        with pytest.raises(ConfigError, match=r"^logging\.(project|tags\[\d\]): a W&B "):
            LoggingConfig(project=project, tags=tags)
