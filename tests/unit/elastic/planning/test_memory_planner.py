"""The memory-true planner: the real model's weights, the experts each stage holds, resident
training state and KV, priced against a device's memory (Qwen3-30B-A3B on 80 GB, and a tiny model)."""
import pytest
import torch

from elastic.planning.choices import PlanChoices
from elastic.planning.dims import planned_dims
from elastic.planning.plan import PlanError
from elastic.planning.planner import make_plan
from elastic.planning.platform import Platform
from elastic.planning.shape import QWEN3_30B_A3B_H100, MemoryBudget
from elastic.sim.costmodel import DEFAULT_COST, CostModel
from elastic.sim.synth import generate, preset
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rl.optim.mixed_precision import training_state_bytes
from megatron_rl.rl.update.train_step import make_optimizer
from megatron_rl.rollout.memory import kv_bytes_per_token, memory_budget, weight_bytes

QWEN3_30B = MoEModelConfig(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                           kv_channels=128, num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                           vocab_size=151936, max_position_embeddings=40960)
GB80 = 80 * 10**9
TINY = MoEModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                      num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, vocab_size=40)


@pytest.mark.parametrize("untie", [True, False])
def test_weight_bytes_are_the_models_own(untie):
    cfg = MoEModelConfig(**{**TINY.to_dict(), "untie_embeddings_and_output_weights": untie})
    model = Qwen3MoeModel(cfg, None, torch.float32)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".local_experts." not in n)
    one_expert = sum(p.numel() for n, p in model.named_parameters() if ".local_experts.3." in n)
    assert weight_bytes(cfg, 4) == (4 * dense, 4 * one_expert)


def test_qwen3_30b_sizes_match_the_published_shape():
    dense, expert = weight_bytes(QWEN3_30B, 2)
    assert expert == QWEN3_30B_A3B_H100.expert_bytes  # 453 MB: 3 x 2048 x 768 x 48 x 2 B
    assert kv_bytes_per_token(QWEN3_30B, 2) == QWEN3_30B_A3B_H100.kv_bytes_per_token  # 96 KiB
    assert abs(dense - QWEN3_30B_A3B_H100.dense_bytes) < 0.02 * dense  # ~3.1 GB
    # 30.5B parameters in all: Qwen3-30B-A3B's model card.
    assert 30.3e9 < (dense + 128 * expert) / 2 < 30.7e9


def test_the_planners_shape_is_the_model_configs_own():
    # One description: the Qwen3-30B-A3B config gives the default shape's sizes, and the cost model
    # built on it prices a step as the default one does; the budget brings its memory and KV bytes.
    budget = memory_budget(QWEN3_30B, 2, torch.device("cpu"), 8, device_bytes=GB80, record_routes=True)
    shape = QWEN3_30B.shape(2, budget, ranks_per_node=8)
    model = ("num_experts", "topk", "num_layers", "hidden_size", "expert_ffn", "bytes_per_param",
             "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size", "ranks_per_node")
    assert [getattr(shape, f) for f in model] == [getattr(QWEN3_30B_A3B_H100, f) for f in model]
    assert shape.kv_bytes_per_token == budget.kv_bytes_per_token > QWEN3_30B_A3B_H100.kv_bytes_per_token  # + routes
    assert (shape.dense_bytes, shape.memory_per_rank_bytes) == (budget.dense_bytes, GB80)
    plain = CostModel(shape=QWEN3_30B.shape(2, memory_budget(QWEN3_30B, 2, torch.device("cpu"), 8), 8))
    assert plain.decode_step_s(32, 3000, 16) == DEFAULT_COST.decode_step_s(32, 3000, 16)


def _plan(cfg, budget, floor, ranks=16, prompts=24, cap=8192, layout="planned"):
    trace = generate(preset("deepscaler", prompts=prompts, samples=8, epochs=3, cap=cap), seed=1)
    shape = cfg.shape(2, budget, ranks_per_node=8)
    return make_plan(trace.epoch(2), trace.before(2),
                     platform=Platform(planned_dims(ranks, shape.num_experts), shape, budget=budget),
                     choices=PlanChoices(floor, True), layout=layout)


def _trainer_resident(cfg, ranks):
    """fp32 masters + two AdamW moments (12 B/param) of the dense weights and a rank's own experts."""
    dense12, expert12 = weight_bytes(cfg, 12)
    return dense12 + cfg.num_moe_experts // ranks * expert12


def test_30b_rollout_on_80gb_holds_every_expert_on_one_rank():
    budget = memory_budget(QWEN3_30B, 2, torch.device("cpu"), 8, device_bytes=GB80)
    # 128 x 453 MB + 3.1 GB of weights leave ~11 GB of the 72 GB usable for KV.
    assert 10e9 < budget.kv_budget_bytes(128) < 12e9
    plan = _plan(QWEN3_30B, budget, floor=1)
    assert plan.floor == 1 and "floor_raised" not in plan.meta


def test_30b_training_on_80gb_refuses_a_floor_that_cannot_hold_the_experts():
    resident = _trainer_resident(QWEN3_30B, 16)
    budget = memory_budget(QWEN3_30B, 2, torch.device("cpu"), 8, resident_bytes=resident, device_bytes=GB80)
    assert 40e9 < resident < 41e9
    # Beside 40 GB of optimizer state, 64 experts (29.0 GB) overflow a rank; 43 (19.5 GB) fit.
    with pytest.raises(PlanError, match=r"floor 2 cannot hold the 128 experts .* a rank would hold 64 "
                                        r"experts \(28\.99 GB\) \+ 3\.\d\d GB dense weights \+ 40\.\d\d GB "
                                        r"resident state of 72\.00 GB usable .*smallest floor that holds "
                                        r"them is 3"):
        _plan(QWEN3_30B, budget, floor=2)
    assert _plan(QWEN3_30B, budget, floor=4).floor == 4  # examples/qwen3_30b_a3b_16xh100.yaml's floor
    # Without the resident state (what `runner.tiny_shape` priced) floor 2 would have been accepted.
    free = memory_budget(QWEN3_30B, 2, torch.device("cpu"), 8, device_bytes=GB80)
    assert _plan(QWEN3_30B, free, floor=2).floor == 2


def test_a_floor_without_room_for_the_largest_response_is_raised():
    dense, kv = weight_bytes(TINY, 2)[0], kv_bytes_per_token(TINY, 2)
    expert = 20_000 * kv  # a budget where each expert a rank gives up frees 20,000 tokens of KV
    # One rank holds all 8 experts with room for 1,000 tokens of KV; the largest response's demand
    # is ~6,000 tokens (cap 4,096 plus its prompt, on the demand grid); floor 2 has 81,000.
    budget = MemoryBudget(device_bytes=dense + 8 * expert + 1000 * kv, dense_bytes=dense,
                          expert_bytes=expert, kv_bytes_per_token=kv, utilization=1.0, source="test")
    big = MemoryBudget(**{**budget.__dict__, "device_bytes": dense + 8 * expert + 10**6 * kv})
    plan = _plan(TINY, budget, floor=1, ranks=4, prompts=8, cap=4096)
    assert plan.floor == 2 and len(plan.stages[-1].members) >= 2
    assert plan.meta["floor_raised"].startswith(f"floor 1 raised to {plan.floor}: at floor 1 a rank holds 8 experts")
    assert "less than the largest response's" in plan.meta["floor_raised"]
    assert _plan(TINY, big, floor=1, ranks=4, prompts=8, cap=4096).floor == 1


def test_trainer_resident_state_is_the_optimizers():
    model = Qwen3MoeModel(TINY, None, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert training_state_bytes(model, make_optimizer(model, 1e-3)) == 12 * params
    fp32 = Qwen3MoeModel(TINY, None, torch.float32)
    assert training_state_bytes(fp32, make_optimizer(fp32, 1e-3), ref_model=fp32) == 8 * params + 4 * params
