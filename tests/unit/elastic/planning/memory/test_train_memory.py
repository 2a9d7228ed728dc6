"""True memory per training rank (elastic/planning/memory/train_memory.py, rl/optim/mixed_precision.py's
training_state_bytes): the DistributedOptimizer's ~16 B/param, ZeRO-1's shard, offload's zero, and
Qwen3-30B-A3B on 80 GB planning more KV under sharding; the torch backend's stacked expert copies
priced; one layer's saved tensors as `layer_saved_bytes` counts them."""
import pytest
import torch

from elastic.planning.memory.train_memory import (
    OptimizerSetup,
    layer_saved_bytes,
    optimizer_state_bytes,
    training_memory,
)
from elastic.planning.shape import MemoryBudget
from megatron_rl.backend_rules import backend_rules
from megatron_rl.config import load_dataclass
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.qwen3_moe import Qwen3MoeModel, rope_cos_sin
from megatron_rl.rl.optim.megatron_train import MegatronOptimizer
from megatron_rl.rl.optim.mixed_precision import training_state_bytes
from megatron_rl.rl.optim.zero import ShardedOptimizer
from megatron_rl.rl.rollout_phase.phase import worst_budget
from megatron_rl.rl.update.train_step import is_expert_param
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.memory import memory_budget
from megatron_rl.rollout.rollout_plan import RolloutPlanner, model_config
from megatron_rl.trainer_config import TrainerConfig
from tools.memory_table import rows

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
    experts (and, on the torch backend, their stacked copies) room for 26 sequences of 8,192 tokens,
    ZeRO-1 for 48, offload for 76; a batch of 40 fits only under sharding."""
    cfg = load_dataclass(TrainerConfig, "examples/qwen3_30b_a3b_16xh100.yaml", {})
    table = {(r["backend"], r["state"]): r for r in rows(cfg, 80 * 10**9)}
    replicated, sharded = table["torch", "replicated"], table["torch", "sharded"]
    assert sharded["kv_budget"] > replicated["kv_budget"] + 15e9
    assert table["torch", "offloaded"]["kv_budget"] > sharded["kv_budget"]
    assert replicated["sequences"] < 40 <= sharded["sequences"]
    # the megatron backend keeps its fp32 gradient buffer through the rollout: less KV than ZeRO-1
    assert replicated["kv_budget"] < table["megatron", "sharded"]["kv_budget"] < sharded["kv_budget"]
    # every placement's update fits in the 72 GB usable but the replicated torch optimizer's (73.0 GB
    # with the traced activations and the stacked expert copies; ZeRO-1 is the default past one rank)
    assert all(r["update_peak"] < r["usable"] for key, r in table.items() if key != ("torch", "replicated"))
    assert replicated["usable"] < replicated["update_peak"] < 80 * 10**9
    budget = MemoryBudget(device_bytes=80 * 10**9, dense_bytes=sharded["dense_weights"], expert_bytes=1,
                          kv_bytes_per_token=1, resident_bytes=sharded["resident"])
    assert budget.kv_budget_bytes(0) > 0


def test_the_torch_backends_stacked_expert_copies_are_priced():
    """`ExpertBank.stacked` keeps a copy of the held experts from a bank's first forward, whatever
    path computes (here float64's per-expert loop): the torch backend's rollout budget prices each
    held expert twice and its training table counts the copy; megatron-core's experts are the stack."""
    model = Qwen3MoeModel(TINY, None, torch.float64)
    model(torch.zeros(1, 3, dtype=torch.long))
    stack = model.moe_layers[0].experts._stacked
    per_layer = sum(p.numel() for e in model.moe_layers[0].experts.local_experts.values() for p in e.parameters())
    assert stack is not None and stack.fc1_E2FD.numel() + stack.fc2_EDF.numel() == per_layer
    assert (backend_rules("torch").expert_copies, backend_rules("megatron").expert_copies) == (1, 0)
    plain = memory_budget(TINY, 8, torch.device("cpu"), 1, device_bytes=10**9)
    copied = memory_budget(TINY, 8, torch.device("cpu"), 1, device_bytes=10**9, expert_copies=1)
    assert plain.kv_budget_bytes(3) - copied.kv_budget_bytes(3) == 3 * plain.expert_bytes
    assert "x2 with their stacked copies" in copied.describe(3)
    setup = OptimizerSetup("torch", "sharded", False, 8)
    dense, experts = _counts(model)
    kw = dict(dense_params=dense, expert_params_per_expert=experts // TINY.num_moe_experts, experts_held=3,
              world=1, setup=setup, activations=0)
    copies = training_memory(**kw, expert_copies=1)
    assert copies.expert_copies == copies.expert_weights == 3 * plain.expert_bytes
    assert copies.update_peak - training_memory(**kw).update_peak == copies.expert_copies
    assert copies.resident == training_memory(**kw).resident  # priced per held expert, not as resident state



@pytest.mark.parametrize("backend,copies", [("torch", 1), ("megatron", 0)])
def test_the_rollout_and_training_planners_price_their_backends_copies(backend, copies):
    rollout = load_dataclass(RolloutConfig, "examples/tiny_cpu.yaml", {"backend": backend, "dtype": "float32"})
    assert RolloutPlanner.for_rollout(rollout, *model_config(rollout), "cpu").budget.expert_copies == copies
    train = load_dataclass(TrainerConfig, "examples/tiny_cpu_grpo.yaml", {"backend": backend, "dtype": "float32"})
    model = Qwen3MoeModel(train.model, None, torch.float32)
    assert worst_budget(train, model, world=1, resident_bytes=0).expert_copies == copies

def test_a_layers_saved_tensors_are_the_arithmetics():
    """What autograd saves in one decoder layer (every storage a backward reads, once), bf16 and fp32,
    against `layer_saved_bytes` (the layer's input is among them in fp32: its input norm's fp32 input)."""
    cfg = MoEModelConfig(**{**TINY.to_dict(), "num_layers": 1, "hidden_size": 64, "vocab_size": 64})
    for dtype in (torch.bfloat16, torch.float32):
        assert _saved_by_one_layer(cfg, dtype, rows=2, seq=48) == 96 * layer_saved_bytes(
            cfg.shape(dtype.itemsize, memory_budget(cfg, dtype.itemsize, torch.device("cpu"), 1), 1)), dtype


def _saved_by_one_layer(cfg: MoEModelConfig, dtype: torch.dtype, rows: int, seq: int) -> int:
    """Bytes of the storages autograd saves in a training forward of one decoder layer, less the
    parameters, the RoPE rows every layer reads and what a layer saves once, not per token: the
    router's fp32 weight (bf16) and the q/k norm weights' [H/G + 1, C] stack."""
    model = Qwen3MoeModel(cfg, None, dtype)
    x = torch.randn(rows, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(seq).expand(rows, seq), cfg.kv_channels, cfg.rotary_base, dtype, seq)
    saved = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.decoder.layers[0](x, cos[:, :, None, None], sin[:, :, None, None], None,
                                torch.ones(rows, seq, dtype=torch.bool))
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), cos, sin)}
    router_fp32 = 4 * cfg.num_moe_experts * cfg.hidden_size if dtype == torch.bfloat16 else 0
    qk_weights = (cfg.heads_per_group + 1) * cfg.kv_channels * dtype.itemsize
    return sum(n for ptr, n in saved.items() if ptr not in skip) - router_fp32 - qk_weights
