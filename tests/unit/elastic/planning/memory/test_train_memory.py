"""True memory per training rank (elastic/planning/memory/train_memory.py, rl/optim/mixed_precision.py's
training_state_bytes): the DistributedOptimizer's ~16 B/param, ZeRO-1's shard, offload's zero, and
Qwen3-30B-A3B on 80 GB planning more KV under sharding."""
import torch

from elastic.planning.memory.train_memory import OptimizerSetup, optimizer_state_bytes
from elastic.planning.shape import MemoryBudget
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rl.optim.megatron_train import MegatronOptimizer
from megatron_rl.rl.optim.mixed_precision import training_state_bytes
from megatron_rl.rl.optim.zero import ShardedOptimizer
from megatron_rl.rl.update.train_step import is_expert_param

TINY = MoEModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                      num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, vocab_size=40)


def _counts(model):
    named = list(model.named_parameters())
    return (sum(p.numel() for n, p in named if not is_expert_param(n)),
            sum(p.numel() for n, p in named if is_expert_param(n)))


def test_distributed_optimizer_state_is_about_16_bytes_per_parameter():
    """The DistributedOptimizer's fp32 masters, two moments and fp32 gradient
    buffer (16 B/param on one rank), not 2 x 2 B of bf16 moments (today's 4 B/param)."""
    model = Qwen3MoeModel(TINY, None, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    megatron = MegatronOptimizer.__new__(MegatronOptimizer)  # the accounting needs no megatron-core
    assert training_state_bytes(model, megatron) == 16 * params
    dense, experts = _counts(model)
    # over 4 data-parallel ranks the dense masters and moments divide, the fp32 grad buffer does not
    assert training_state_bytes(model, megatron, world=4) == 12 * dense // 4 + 4 * dense + 16 * experts


def test_sharded_and_offloaded_device_state():
    model = Qwen3MoeModel(TINY, None, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-3)

    one = ShardedOptimizer(model, adamw, 0, 1, 1.0, is_expert=is_expert_param)
    assert training_state_bytes(model, one) == 12 * params  # one rank owns the whole dense part
    one.close()
    off = ShardedOptimizer(model, adamw, 0, 1, 1.0, offload=True, is_expert=is_expert_param)
    assert training_state_bytes(model, off) == 0 and all(m.device.type == "cpu" for _, m in off.pairs)
    off.close()
    dense, experts = _counts(model)
    sharded = OptimizerSetup("torch", "sharded", True, 2)
    assert optimizer_state_bytes(dense, experts, 4, sharded)[0] == 12 * dense // 4 + 12 * experts


def test_30b_on_80gb_plans_a_larger_kv_budget_under_sharding():
    """Qwen3-30B-A3B on 16 x 80 GB in bf16: the replicated optimizer leaves a rank holding its 8
    experts room for 31 sequences of 8,192 tokens, ZeRO-1 for 52, offload for 81; a batch of 40
    fits only under sharding."""
    from megatron_rl.config import load_dataclass
    from megatron_rl.trainer_config import TrainerConfig
    from tools.memory_table import rows

    cfg = load_dataclass(TrainerConfig, "examples/qwen3_30b_a3b_16xh100.yaml", {})
    table = {(r["backend"], r["state"]): r for r in rows(cfg, 80 * 10**9)}
    replicated, sharded = table["torch", "replicated"], table["torch", "sharded"]
    assert sharded["kv_budget"] > replicated["kv_budget"] + 15e9
    assert table["torch", "offloaded"]["kv_budget"] > sharded["kv_budget"]
    assert replicated["sequences"] < 40 <= sharded["sequences"]
    # the megatron backend keeps its fp32 gradient buffer through the rollout: less KV than ZeRO-1
    assert replicated["kv_budget"] < table["megatron", "sharded"]["kv_budget"] < sharded["kv_budget"]
    # every placement's update fits in the 72 GB usable
    assert all(r["update_peak"] < r["usable"] for r in table.values())
    budget = MemoryBudget(device_bytes=80 * 10**9, dense_bytes=sharded["dense_weights"], expert_bytes=1,
                          kv_bytes_per_token=1, resident_bytes=sharded["resident"])
    assert budget.kv_budget_bytes(0) > 0
