import dataclasses

import pytest

from elastic.sim.costmodel import DEFAULT_COST
from elastic.sim.step_fit import calibrate, calibrate_transitions, fit_error

NODE_OF_4 = dataclasses.replace(DEFAULT_COST.shape, ranks_per_node=4)


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
    truth = dataclasses.replace(DEFAULT_COST, shape=NODE_OF_4, host_cores=1.5, step_overhead_s=3e-3,
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
    base = dataclasses.replace(DEFAULT_COST, shape=NODE_OF_4)
    per_expert = base.shape.expert_bytes / 2e9
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
