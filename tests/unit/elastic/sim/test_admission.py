import numpy as np
import pytest

from elastic.planning.kv_unit import KVUnit
from elastic.planning.shape import ModelShape
from elastic.sim.admission import admit
from elastic.sim.costmodel import DEFAULT_COST
from elastic.sim.replay import Policy, simulate_trace
from elastic.sim.simulate import SimConfig
from elastic.sim.synth import generate, preset

SLOT = 4096  # a 96-token prompt plus a 4000-token cap: a whole number of 16-position pages
PROMPT = 96


def _peak(start, length, held=None):
    """Most requests (and KV positions) decoding at once, from their start and end steps."""
    held = np.ones(len(start), dtype=np.int64) if held is None else held
    steps = np.arange(1, int((start + length).max()) + 1)
    live = (start[:, None] < steps[None, :]) & (steps[None, :] <= (start + length)[:, None])
    return int(live.sum(axis=0).max()), int((live * held[:, None]).sum(axis=0).max())


def _admit(kv, tokens, slots=10):
    tokens = np.asarray(tokens, dtype=np.int64)
    prompt = np.full(len(tokens), PROMPT, dtype=np.int64)
    held = KVUnit(kv, 16).held(prompt, tokens, SLOT)
    length = np.maximum(tokens - 1, 0)
    start = admit(np.zeros(len(tokens), dtype=np.int64), length, held, {0: slots * SLOT})
    return start, length, held


def test_pages_admit_more_requests_than_slots_in_a_length_tailed_batch():
    rng = np.random.default_rng(0)
    tokens = np.minimum(np.rint(np.exp(rng.normal(np.log(300), 0.9, 64))), SLOT - PROMPT).astype(np.int64)
    tokens[:3] = SLOT - PROMPT  # the tail reaches the cap
    slots = _admit("slots", tokens)
    paged = _admit("paged", tokens)
    for start, length, held in (slots, paged):
        assert _peak(start, length, held)[1] <= 10 * SLOT  # never more KV than the budget
    assert _peak(*slots[:2])[0] == 10
    assert _peak(*paged[:2])[0] >= 3 * 10
    # More requests at once: the batch ends in fewer decode steps.
    assert (paged[0] + paged[1]).max() < (slots[0] + slots[1]).max()


def test_pages_and_slots_admit_alike_when_every_request_runs_to_the_longest_length():
    tokens = np.full(40, SLOT - PROMPT)
    slots, paged = _admit("slots", tokens), _admit("paged", tokens)
    np.testing.assert_array_equal(slots[0], paged[0])
    assert _peak(*slots[:2])[0] == _peak(*paged[:2])[0] == 10


def test_a_request_larger_than_its_ranks_budget_is_named():
    with pytest.raises(ValueError, match="request 1 holds 4096 KV positions, more than rank 0's budget of 4000"):
        admit(np.zeros(2, dtype=np.int64), np.array([5, 9]), np.array([100, 4096]), {0: 4000})


def test_the_simulator_decodes_fewer_requests_at_once_under_slots():
    # 4 ranks of 80 GB holding 32 experts each leave KV for 32 slots of a 16k-token response, while
    # each rank holds 64 responses of about 2,000 tokens: slots queue half of them, pages none.
    trace = generate(preset("deepscaler", prompts=32, samples=8, epochs=2), seed=0)
    run = {kv: simulate_trace(trace, Policy("vanilla", 4), ranks=4, cost=DEFAULT_COST, shape=ModelShape(),
                              config=SimConfig(kv=kv)).summary() for kv in ("tokens", "slots", "paged")}
    budget = ModelShape().kv_budget_bytes(32) // ModelShape().kv_bytes_per_token
    slot = max(r.prompt_len for r in trace.epoch(1)) + max(r.response_len for r in trace.epoch(1))
    assert run["slots"]["kv"]["peak_concurrent_per_rank"] == budget // slot < 64
    assert run["paged"]["kv"]["peak_concurrent_per_rank"] == 64 and "kv" not in run["tokens"]
    assert run["slots"]["rollout_time_s"] > run["paged"]["rollout_time_s"] == run["tokens"]["rollout_time_s"]
    assert run["slots"]["response_tokens"] == run["paged"]["response_tokens"]


def test_simulate_takes_the_admission_as_a_flag_and_the_page_size_as_an_override(capsys, tailed_trace):
    import yaml

    from megatron_rl.cli import main

    assert main(["simulate", "--trace", str(tailed_trace), "--kv", "paged", "kv_page_size=32", "--print-config"]) == 0
    c = yaml.safe_load(capsys.readouterr().out)
    assert (c["kv"], c["kv_page_size"]) == ("paged", 32)
    assert main(["simulate", "--trace", str(tailed_trace), "kv_page_size=0", "--print-config"]) == 2
    assert "kv_page_size: expected >= 1, got 0" in capsys.readouterr().err
