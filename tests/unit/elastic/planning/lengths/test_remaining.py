"""Online re-prediction: tokens so far and finished siblings update a live response's remaining length."""
import math

import numpy as np
import pytest

from elastic.planning.lengths.predict import LengthDist, log_norm_sf, norm_ppf, norm_ppf_array
from elastic.planning.lengths.remaining import OnlineModel, OnlineOptions, SiblingFit, conditioned, online_model
from elastic.sim.synth import generate, preset


def test_vector_normal_helpers_match_scalar():
    p = np.array([1e-12, 0.01, 0.3, 0.5, 0.9, 0.999])
    assert np.allclose(norm_ppf_array(p), [norm_ppf(float(x)) for x in p])
    x = np.array([-6.0, -1.0, 0.0, 1.5, 8.0, 40.0])
    import math
    want = [math.log(0.5 * math.erfc(v / math.sqrt(2))) if v < 30 else None for v in x]
    for got, w in zip(log_norm_sf(x), want):
        if w is not None:
            assert got == pytest.approx(w, rel=1e-5, abs=1e-9)
    assert np.isfinite(log_norm_sf(x)).all()  # the far tail stays finite (log space)


def test_sibling_icc_is_fitted_from_history():
    """Siblings tell something where a prompt's samples share an effect history did not predict
    (drift), and nothing on the trace without per-prompt signal."""
    shared = generate(preset("deepscaler", epochs=4, prompts=64, drift=1.0), seed=0)
    none = generate(preset("nosignal", epochs=4, prompts=64), seed=0)
    fit_shared, fit_none = SiblingFit.fit(shared.before(3)), SiblingFit.fit(none.before(3))
    assert fit_shared.icc > 0.3
    assert fit_none.icc < 0.1
    assert 0.8 < fit_none.scale < 1.2


def _model(icc, options=None, n=4):
    options = options or OnlineOptions()
    dists = [LengthDist(np.log1p(1000.0), 0.8, 16384, True)] * n
    return OnlineModel(dists, ["a"] * n, SiblingFit(icc, 0.0, 1.0, 100), options)


def test_conditioning_on_tokens_so_far():
    m = _model(0.0)
    rng = np.random.default_rng(0)
    done = np.zeros(4, bool)
    means = []
    for t in (10, 1000, 5000):
        tokens = np.full(4, t)
        rem = m.sample_remaining(np.arange(4), tokens, done, 400, rng)
        assert (rem >= 1).all() and (rem + t <= 16384).all()
        means.append(float(np.mean(rem + t)))
    assert means[0] < means[1] < means[2]  # a response that ran long is expected to run longer
    off = _model(0.0, OnlineOptions(conditional=False))
    rem = off.sample_remaining(np.arange(4), np.full(4, 5000), done, 400, rng)
    assert np.mean(rem + 5000) < means[2]


@pytest.mark.parametrize("siblings", [True, False])
def test_finished_siblings_move_the_prediction(siblings):
    m = _model(0.6, OnlineOptions(siblings=siblings))
    done = np.array([True, True, True, False])
    rng = np.random.default_rng(1)
    long = m.sample_remaining(np.array([3]), np.array([8000, 9000, 7000, 50]), done, 800, rng).mean()
    short = m.sample_remaining(np.array([3]), np.array([60, 80, 70, 50]), done, 800, rng).mean()
    if siblings:
        assert long > 2 * short
    else:
        assert long == pytest.approx(short, rel=0.2)


def test_online_model_is_calibrated_mid_rollout():
    trace = generate(preset("deepscaler"), seed=2)
    e = trace.epochs[-1]
    batch = trace.epoch(e)
    model = online_model(batch, trace.before(e), None)
    lengths = np.array([r.response_len for r in batch])
    tokens = np.minimum(lengths, 1500)
    done = lengths <= 1500
    live = np.nonzero(~done)[0]
    rem = model.sample_remaining(live, tokens, done, 200, np.random.default_rng(0))
    truth = lengths[live] - tokens[live]
    assert 0.8 < np.mean(truth <= np.quantile(rem, 0.9, axis=0)) < 0.97
    assert 0.4 < np.mean(truth <= np.median(rem, axis=0)) < 0.6


@pytest.mark.parametrize("sd", [0.0, 0.4, 1.0])
def test_conditioned_is_what_is_left(sd):
    d = LengthDist(math.log1p(2000), sd, 16384, True)
    assert conditioned(d, 0) == d
    rng = np.random.default_rng(0)
    full = np.minimum(np.expm1(d.mu + d.sd * rng.standard_normal(400_000)), d.cap)
    for t in (100, 2000, 6000, 16000):
        c = conditioned(d, t)
        assert c.cap == d.cap - t
        if sd == 0:
            assert c.median == pytest.approx(max(2000 - t, 1))
            continue
        # Against Monte Carlo of L - t given L > t: the median and the 90% quantile match.
        rest = full[full > t + 0.5] - t
        if len(rest) < 2000:
            continue
        for p in (0.5, 0.9):
            q = float(np.quantile(rest, p))
            assert abs(c.quantile(p) - q) <= 0.03 * q + 2, (t, p, c.quantile(p), q)


def test_posterior_adds_each_siblings_evidence_in_response_order():
    """Each prompt's posterior is its prior plus every sample's log-likelihood (a finished one's
    density, a live one's survival past its tokens so far), summed in response order, bit for bit:
    the online rule's samples, and so its decisions, must not depend on how the sums are vectorised."""
    rng = np.random.default_rng(3)
    prompts = [f"p{i}" for i in rng.integers(0, 9, 60)]
    dists = [LengthDist(float(mu), float(sd), 4096, True)
             for mu, sd in zip(rng.uniform(3, 7, 60), rng.uniform(0, 1, 60))]
    model = OnlineModel(dists, prompts, SiblingFit(0.5, 0.1, 1.2, 100))
    tokens = rng.integers(1, 4096, 60).astype(float)
    done = rng.random(60) < 0.5
    tokens[:3], done[:3] = 4096, True  # cut at the cap: a survival, not a density
    loc = model.fit.bias + model.b[None, :]
    exact = done & (tokens < 4096)
    z = (np.log1p(np.where(done, tokens, tokens + 0.5)) - model.mu) / model.sd
    ll = np.zeros((60, len(model.b)))
    ll[exact] = -0.5 * ((z[exact, None] - loc) / model.noise) ** 2
    ll[~exact] = log_norm_sf((z[~exact, None] - loc) / model.noise)
    sums = np.zeros((model.groups, len(model.b)))
    np.add.at(sums, model.group, ll)
    post = np.tile(model.log_prior, (model.groups, 1)) + sums
    w = np.exp(post - post.max(axis=1, keepdims=True))
    assert np.array_equal(model.posterior(tokens, done), w / w.sum(axis=1, keepdims=True))
