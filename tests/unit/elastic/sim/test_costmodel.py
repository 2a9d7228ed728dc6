import dataclasses

import numpy as np
import pytest

from elastic.planning.shape import ModelShape
from elastic.planning.step_cost import ShapeCost, step_table
from elastic.sim.costmodel import DEFAULT_COST, CostModel, calibrate, calibrate_transitions, fit_error
from megatron_rl.config import load_dataclass
from megatron_rl.errors import ConfigError


def test_defaults_are_qwen3_30b_a3b_shapes():
    c = DEFAULT_COST
    assert c.expert_params_per_layer * c.bytes_per_param == pytest.approx(9.44e6, rel=0.01)
    assert c.kv_bytes_per_token == 96 * 1024
    assert c.num_experts == 128 and c.topk == 8 and c.num_layers == 48
    # Experts are ~58 GB of the ~61 GB checkpoint (REFERENCES.md).
    assert c.expert_bytes * c.num_experts == pytest.approx(58e9, rel=0.02)


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
    assert spread == pytest.approx(c.shrink_fixed_s + c.expert_bytes / c.transfer_inter_bytes_per_s)
    assert c.shrink_s(0, 8) == 0.0 and c.shrink_s(64, 8) < c.shrink_s(64, 16)
    # 16 -> 8 moves 64 experts onto 8 survivors across nodes: 8 experts each.
    assert c.shrink_s(64, 16) == pytest.approx(c.shrink_fixed_s + 8 * c.expert_bytes / c.transfer_inter_bytes_per_s)


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
    with pytest.raises(ConfigError, match=r"neg\.yaml.*hbm_bytes_per_s must be > 0"):
        load_dataclass(CostModel, neg)


def _samples(model, ranks=(1, 2, 4)):
    return [(b, ctx, g, model.decode_step_s(b, ctx, g))
            for b in (1, 3, 8, 16) for ctx in (20, 200, 900) for g in ranks]


def test_calibrate_recovers_the_constants_that_made_the_samples():
    truth = dataclasses.replace(DEFAULT_COST, step_overhead_s=7e-3, hbm_bytes_per_s=9e11, flops_per_s=2e14,
                                a2a_intra_latency_s=1.5e-4, a2a_intra_per_peer_s=4e-5)
    fitted = calibrate(_samples(truth), base=DEFAULT_COST)
    for name in ("step_overhead_s", "hbm_bytes_per_s", "flops_per_s", "a2a_intra_latency_s", "a2a_intra_per_peer_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.02), name
    assert fit_error(fitted, _samples(truth)) < 1e-3
    assert fit_error(DEFAULT_COST, _samples(truth)) > 0.1


def test_calibrate_keeps_unseen_terms_and_rejects_too_few_samples():
    # Single-rank samples say nothing about the all-to-all: its latency stays at the base value.
    truth = dataclasses.replace(DEFAULT_COST, step_overhead_s=5e-3)
    fitted = calibrate(_samples(truth, ranks=(1,)), base=DEFAULT_COST)
    assert fitted.a2a_intra_latency_s == DEFAULT_COST.a2a_intra_latency_s
    assert fitted.step_overhead_s == pytest.approx(5e-3, rel=0.02)
    with pytest.raises(ValueError, match="at least 2"):
        calibrate([(1, 10, 1, 0.1)])


def test_calibrate_fits_the_cores_ranks_share_from_drained_members():
    # A CPU host: 4 ranks on cores that other load has cut to 1.5. Samples with drained members
    # (busy < ep_size) tell the cores apart from the overhead; balanced ones alone could not.
    truth = dataclasses.replace(DEFAULT_COST, ranks_per_node=4, host_cores=1.5, step_overhead_s=3e-3,
                                a2a_intra_latency_s=2e-3, a2a_intra_per_peer_s=1e-3)
    base = dataclasses.replace(truth, host_cores=2, step_overhead_s=1e-3)
    samples = [(b, ctx, g, truth.decode_step_s(b, ctx, g, k), k)
               for b in (1, 16) for ctx in (20, 900) for g in (1, 2, 3, 4) for k in range(1, g + 1)]
    fitted = calibrate(samples, base=base)
    assert fitted.host_cores == 1.5
    assert fitted.step_overhead_s == pytest.approx(3e-3, rel=0.02)
    assert fit_error(fitted, samples) < 1e-3
    # Fewer busy members compete for fewer cores: the step is faster, never slower.
    assert truth.decode_step_s(16, 900, 4, 1) < truth.decode_step_s(16, 900, 4, 3) < truth.decode_step_s(16, 900, 4)


def test_calibrate_transitions_tells_fixed_cost_from_transfer_rate():
    base = dataclasses.replace(DEFAULT_COST, ranks_per_node=4)
    per_expert = base.expert_bytes / 2e9
    two = [(4, 2, 0), (5, 2, 1), (6, 3, 0), (7, 3, 1)]  # busiest rank moves 2 experts
    six = [(e, 0, r) for e, r in ((2, 1), (3, 1), (4, 2), (5, 2), (6, 3), (7, 3))]  # rank 0 moves 6
    shrinks = [(two, 0.004 + 2 * per_expert), (six, 0.004 + 6 * per_expert)]
    restores = [(two, 0.004 + 2 * per_expert + 0.01)]
    fitted = calibrate_transitions(shrinks, restores, base)
    assert fitted.shrink_fixed_s == pytest.approx(0.004)
    assert fitted.transfer_intra_bytes_per_s == pytest.approx(2e9)
    assert fitted.restore_extra_s == pytest.approx(0.01)
    # One load only: the rate stays base's and the fixed cost takes the rest.
    same = calibrate_transitions(shrinks[:1], [], base)
    assert same.transfer_intra_bytes_per_s == base.transfer_intra_bytes_per_s
    assert same.transfer_s(two) == pytest.approx(shrinks[0][1])
    with pytest.raises(ValueError, match="leaves the node"):
        calibrate_transitions([([(0, 0, 9)], 0.1)], [], base)


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
