import numpy as np
import pytest

from elastic.planning.shape import ModelShape
from elastic.planning.step_cost import ShapeCost, step_table
from elastic.sim.costmodel import DEFAULT_COST, CostModel
from megatron_rl.config import load_dataclass
from megatron_rl.errors import ConfigError


def test_defaults_are_qwen3_30b_a3b_shapes():
    c = DEFAULT_COST.shape
    assert c == ModelShape()  # the cost model composes the planner's shape
    assert c.expert_params_per_layer * c.bytes_per_param == pytest.approx(9.44e6, rel=0.01)
    # 48 layers x (K, V) x 4 KV heads x 128 head dim x 2 bytes = 96 KiB, derived from the heads.
    assert c.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2 == 96 * 1024
    assert c.num_experts == 128 and c.topk == 8 and c.num_layers == 48
    # Experts are ~58 GB of the ~61 GB checkpoint (REFERENCES.md).
    assert c.expert_bytes * c.num_experts == pytest.approx(58e9, rel=0.02)
    # Read per step: attention (q, o 2048x4096; k, v 2048x512) and router (2048x128) per layer, LM head.
    assert c.step_dense_params == 48 * (2 * 2048 * 4096 + 2 * 2048 * 512 + 2048 * 128) + 151936 * 2048
    assert c.attn_flops_per_kv_token == 4 * 32 * 128 * 48


def test_a_shape_with_more_kv_heads_costs_more_per_step_and_names_the_cost_model():
    wide = CostModel(shape=ModelShape(name="wide", num_query_groups=8))
    assert wide.name == "wide" and wide.shape.kv_bytes_per_token == 2 * DEFAULT_COST.shape.kv_bytes_per_token
    assert wide.decode_step_s(16, 4000, 8) > DEFAULT_COST.decode_step_s(16, 4000, 8)
    assert CostModel(name="mine").name == "mine"


def test_step_time_is_monotone_in_batch_context_and_spans_nodes():
    c = DEFAULT_COST
    assert c.decode_step_s(1, 1000, 16) < c.decode_step_s(8, 1000, 16) < c.decode_step_s(64, 1000, 16)
    assert c.decode_step_s(32, 1000, 8) < c.decode_step_s(32, 8000, 8)
    # An all-to-all that spans nodes costs more than one inside an NVLink node.
    assert float(c.a2a_s(16, 1)) > 2 * float(c.a2a_s(8, 1))
    assert float(c.a2a_s(1, 64)) == 0.0
    assert float(c.a2a_s(64, 1)) > float(c.a2a_s(16, 1))


def test_lower_bound_step_never_exceeds_a_real_step():
    c = DEFAULT_COST
    rng = np.random.default_rng(0)
    for _ in range(200):
        g = int(rng.choice([1, 2, 4, 8, 16, 32, 64]))
        n = int(rng.integers(1, 128))
        ctx = float(rng.integers(1, 20000))
        assert c.min_decode_step_s(ctx, g) <= c.decode_step_s(n, ctx, g) + 1e-12


def test_transfers_across_nodes_are_slower_than_inside_one():
    c = DEFAULT_COST
    intra = c.transfer_s([(e, 1, 0) for e in range(8)])
    inter = c.transfer_s([(e, 9, 0) for e in range(8)])
    assert c.shrink_fixed_s < intra < inter
    assert c.transfer_s([]) == 0.0
    # Senders and receivers work in parallel: 8 moves to 8 receivers cost one move, not eight.
    spread = c.transfer_s([(e, 8 + e, e) for e in range(8)])
    assert spread == pytest.approx(c.shrink_fixed_s + c.shape.expert_bytes / c.transfer_inter_bytes_per_s)
    assert c.shrink_s(0, 8) == 0.0 and c.shrink_s(64, 8) < c.shrink_s(64, 16)
    # 16 -> 8 moves 64 experts onto 8 survivors across nodes: 8 experts each.
    per_expert = c.shape.expert_bytes / c.transfer_inter_bytes_per_s
    assert c.shrink_s(64, 16) == pytest.approx(c.shrink_fixed_s + 8 * per_expert)


def test_yaml_overrides_and_names_the_file_on_mistakes(tmp_path):
    good = tmp_path / "cost.yaml"
    good.write_text("step_overhead_s: 0.004\na2a_inter_latency_s: [[16, 1.0e-4], [64, 2.0e-4]]\n")
    c = load_dataclass(CostModel, good)
    assert c.step_overhead_s == 0.004 and c.a2a_inter_latency_s == ((16, 1e-4), (64, 2e-4))
    typo = tmp_path / "typo.yaml"
    typo.write_text("hbm_bytes_per_sec: 1.0e12\n")
    with pytest.raises(ConfigError, match=r"typo\.yaml.*hbm_bytes_per_sec"):
        load_dataclass(CostModel, typo)
    neg = tmp_path / "neg.yaml"
    neg.write_text("hbm_bytes_per_s: -1\n")
    with pytest.raises(ConfigError, match=r"neg\.yaml.*hbm_bytes_per_s: expected > 0"):
        load_dataclass(CostModel, neg)
    shaped = tmp_path / "shape.yaml"
    shaped.write_text("shape: {num_experts: 64, kv_channels: 64}\n")
    c = load_dataclass(CostModel, shaped)
    assert c.shape.num_experts == 64 and c.shape.kv_bytes_per_token == DEFAULT_COST.shape.kv_bytes_per_token // 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("shape: {topk: 300}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*topk"):
        load_dataclass(CostModel, bad)


def test_scaled_model_is_uniformly_slower():
    c = DEFAULT_COST
    slow = c.scaled(2.5)
    for args in ((1, 100, 1), (16, 3000, 8), (64, 8000, 16)):
        assert slow.decode_step_s(*args) == pytest.approx(2.5 * c.decode_step_s(*args))
    assert slow.transfer_s([(0, 9, 0)]) == pytest.approx(2.5 * c.transfer_s([(0, 9, 0)]))
    with pytest.raises(ValueError):
        c.scaled(0)


def test_step_table_prices_whole_tables_as_the_scalar_calls_do():
    # The planner prices its timelines with one array call on the simulator's model; a cost model
    # without `takes_arrays` is called per entry. Both must give the scalar calls' figures.
    batch = np.array([1, 3, 17, 64, 200])
    context = np.array([50, 900, 3000, 12000, 16000])
    for cost in (CostModel(), ShapeCost(ModelShape())):
        for g in (1, 4, 8, 16, 64):
            want = [cost.decode_step_s(int(b), int(c), g) for b, c in zip(batch, context)]
            np.testing.assert_allclose(step_table(cost, batch, context, g), want, rtol=1e-12)


def test_simulate_model_names_the_cost_models_shape(capsys, tailed_trace):
    import yaml

    from megatron_rl.cli import main

    argv = ["simulate", "--trace", str(tailed_trace), "--model", "qwen3-30b-a3b@h200-141g", "--print-config"]
    assert main(argv) == 0
    shape = yaml.safe_load(capsys.readouterr().out)["cost"]["shape"]
    assert (shape["name"], shape["memory_per_rank_bytes"]) == ("qwen3-30b-a3b@h200-141g", 141 * 10**9)
    assert main(argv + ["cost.shape.ranks_per_node=4"]) == 2
    assert "cost.shape: expected --model or cost.shape fields, not both" in capsys.readouterr().err
