import numpy as np
import pytest

from elastic.planning.memory.kv_unit import kv_unit, share_groups
from elastic.planning.shape import ModelShape
from elastic.sim.admission import admit, start_steps
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
    held = kv_unit(kv, 16).held(prompt, tokens, SLOT)
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


PAGED = kv_unit("paged", 16)


def _paged(groups, tokens, length, budget, prompt=32):
    """Start steps of one rank's requests (`groups`: each one's GRPO group) under pages of 16."""
    prompt = np.full(len(tokens), prompt, dtype=np.int64)
    held = PAGED.held(prompt, np.asarray(tokens, dtype=np.int64), 0)
    return admit(np.zeros(len(tokens), dtype=np.int64), np.asarray(length), held, {0: budget}, groups,
                 PAGED.shared(prompt)).tolist()


def test_a_groups_samples_admitted_together_hold_its_prompt_pages_once():
    # A 32-position prompt and 32 tokens: 4 pages, 2 of them the prompt's. Three samples fit 128
    # positions only together: 64 + 32 + 32. Apart (three prompts) the third waits for the first.
    assert _paged(["g", "g", "g"], [32, 32, 32], [10, 20, 5], 128) == [0, 0, 0]
    assert _paged(["a", "b", "c"], [32, 32, 32], [10, 20, 5], 128) == [0, 0, 10]
    # A 40-position prompt shares its 2 full pages only, its partial third page is each sample's
    # own: in 96 positions the third sample (64 alone, 32 beside the others) waits for room, until
    # the first ends at 10 (32 back, the shared pages still held) and then, a later prefill that
    # shares nothing, for the second at 20. Sharing 3 pages would fit all three at once: 64 + 16 + 16.
    assert _paged(["g", "g", "g"], [24, 24, 24], [10, 20, 5], 96, prompt=40) == [0, 0, 20]


def test_samples_admitted_at_different_steps_share_nothing():
    # g1 and x (64 each) fill 128 at step 0; g2 waits for x (step 10) and then holds all 64 of its
    # positions, though g1 still decodes: it prefills its own prompt. z (32) waits for g2's end (15);
    # had g2 shared g1's prompt pages, z would have fit at step 10.
    assert _paged(["g", "x", "g", "z"], [32, 32, 32, 0], [20, 10, 5, 1], 128) == [0, 0, 10, 15]


def test_shared_pages_return_when_their_last_holder_ends():
    # g1 (64, 32 of them shared) and g2 (32 more) fill 96. w (64) waits: g1's end at 5 returns its
    # own 32 only, g2's at 20 its own and the shared 32.
    assert _paged(["g", "g", "w"], [32, 32, 32], [5, 20, 1], 96) == [0, 0, 20]
    # The same when the first holder ends last.
    assert _paged(["g", "g", "w"], [32, 32, 32], [20, 5, 1], 96) == [0, 0, 20]


class _Budget:
    """A shape whose ranks each leave `positions` KV positions, whatever experts they hold."""
    kv_bytes_per_token = 1

    def __init__(self, positions):
        self.positions = positions

    def kv_budget_bytes(self, experts_held):
        return self.positions


@pytest.mark.parametrize("kind, cap", [("slots", None), ("tokens", 5)])
def test_slots_and_tokens_share_nothing(kind, cap):
    # Groups of 8 on 2 ranks, a budget (under `tokens` a cap) that binds: the start steps are those
    # of a batch with no groups.
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 600, 64)
    prompt = np.repeat(rng.integers(20, 200, 8), 8)
    rank, length = np.tile([0, 1], 32), tokens - 1
    groups = share_groups([(f"p{i // 8}", i % 8) for i in range(64)])
    shape, owned, budget = _Budget(3000), np.zeros(2), {0: 3000, 1: 3000}
    unit = kv_unit(kind, 16)
    held = unit.held(prompt, tokens, int(prompt.max() + tokens.max()))
    alone = admit(rank, length, held, budget if unit.queues else None, max_batch=cap)
    assert alone.max() > 0  # the budget binds
    np.testing.assert_array_equal(start_steps(unit, shape, owned, rank, prompt, tokens, length, groups, cap), alone)
    # The same batch under pages: its groups share, so requests start sooner, none later.
    alone = admit(rank, length, PAGED.held(prompt, tokens, 0), budget)
    shared = start_steps(PAGED, shape, owned, rank, prompt, tokens, length, groups)
    assert (shared <= alone).all() and (shared < alone).any()


def test_a_resumed_response_is_its_own_sharing_group():
    keys = [("p", 0), ("p", 1), ("p", 2), ("q", 0)]
    assert share_groups(keys) == ["p", "p", "p", "q"]
    assert share_groups(keys, {("p", 1): 40, ("p", 2): 0}) == ["p", ("p", 1), "p", "q"]


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


def test_a_cap_delays_the_request_past_it_to_the_first_end():
    # At most 2 at once and no budget: the third (ends 4 and 10 decoding) starts when the second
    # ends at 4, the fourth when the first ends at 10; uncapped, all four start at the prefill.
    rank, length, held = np.zeros(4, dtype=np.int64), np.array([10, 4, 7, 3]), np.full(4, 100)
    assert admit(rank, length, held, None, max_batch=2).tolist() == [0, 0, 4, 10]
    assert admit(rank, length, held, None).tolist() == [0, 0, 0, 0]
    # Each rank counts its own: rank 1's two requests both start at the prefill.
    assert admit(np.array([0, 1, 0, 1, 0]), np.array([5, 5, 5, 5, 5]), np.full(5, 1), None,
                 max_batch=2).tolist() == [0, 0, 0, 0, 5]


def test_the_cap_applies_on_top_of_the_kv_budget_and_the_shared_pages():
    # Three samples of a group that fit 128 positions together (the shared case above): 2 at once,
    # so the third waits for the first end (10) and, a later prefill, shares nothing.
    assert _paged(["g", "g", "g"], [32, 32, 32], [10, 20, 5], 128) == [0, 0, 0]
    groups, tokens, length = ["g", "g", "g"], np.full(3, 32), np.array([10, 20, 5])
    prompt = np.full(3, 32)
    held = PAGED.held(prompt, tokens, 0)
    assert admit(np.zeros(3, dtype=np.int64), length, held, {0: 128}, groups, PAGED.shared(prompt),
                 max_batch=2).tolist() == [0, 0, 10]
    # Where the budget binds first (three prompts, 64 each in 128), the cap of 2 adds nothing; a cap
    # of 1 delays each to the end of the one before.
    apart = (np.zeros(3, dtype=np.int64), length, np.full(3, 64), {0: 128})
    assert admit(*apart, max_batch=2).tolist() == admit(*apart).tolist() == [0, 0, 10]
    assert admit(*apart, max_batch=1).tolist() == [0, 10, 30]


def test_under_tokens_only_a_cap_binds():
    # A budget of 10 positions that every request exceeds: `tokens` admits them all at the prefill
    # (no budget), and with a cap only as slots free.
    rank, prompt, tokens = np.zeros(3, dtype=np.int64), np.full(3, 50), np.array([20, 30, 40])
    args = (kv_unit("tokens"), _Budget(10), np.zeros(1), rank, prompt, tokens, tokens - 1, ["a", "b", "c"])
    assert start_steps(*args).tolist() == [0, 0, 0]
    assert start_steps(*args, max_batch=1).tolist() == [0, 19, 48]


def _capped_trace():
    # 4 ranks of 64 responses of about 2,000 tokens (as above).
    return generate(preset("deepscaler", prompts=32, samples=8, epochs=2), seed=0)


@pytest.mark.parametrize("kv", ["tokens", "slots", "paged"])
def test_the_simulator_decodes_at_most_max_batch_requests_at_once(kv):
    from elastic.sim.admission import peak_concurrent
    from elastic.sim.replay import make_policy_plan, make_policy_rule
    from elastic.sim.simulate import _Rollout

    trace, cost, shape = _capped_trace(), DEFAULT_COST, ModelShape()
    run = {cap: simulate_trace(trace, Policy("vanilla", 4), ranks=4, cost=cost, shape=shape,
                               config=SimConfig(kv=kv, max_batch=cap)).summary() for cap in (None, 16)}
    assert run[16]["kv"]["peak_concurrent_per_rank"] == run[16]["kv"]["max_batch"] == 16
    assert run[16]["rollout_time_s"] > run[None]["rollout_time_s"]
    assert run[16]["response_tokens"] == run[None]["response_tokens"]
    # The online rule's moves respect the receivers' slots: the cap holds after them as well.
    config, batch = SimConfig(kv=kv, max_batch=16), trace.epoch(1)
    plan = make_policy_plan(Policy("adaptive", 2), batch, trace.before(1), ranks=4, shape=shape, cost=cost,
                            kv=config.unit)
    rule = make_policy_rule(Policy("adaptive", 2), plan, batch, trace.before(1), shape=shape, cost=cost,
                            config=config)
    assert rule.config.max_batch == 16
    sim = _Rollout(plan, batch, cost, shape, config)
    res = sim.run(rule)
    assert res.migrated > 0 and max(peak_concurrent(sim.at.live)) <= 16


@pytest.mark.parametrize("kv", ["tokens", "slots", "paged"])
def test_a_cap_that_never_binds_changes_nothing_but_the_kv_block(kv):
    trace = _capped_trace()
    run = {cap: simulate_trace(trace, Policy("adaptive", 2), ranks=4, cost=DEFAULT_COST, shape=ModelShape(),
                               config=SimConfig(kv=kv, max_batch=cap)).summary() for cap in (None, 256)}
    kv_block = run[256].pop("kv")
    assert kv_block["max_batch"] == 256 > kv_block["peak_concurrent_per_rank"]
    assert run[None].pop("kv", None) in (None, {k: v for k, v in kv_block.items() if k != "max_batch"})
    assert run[256] == run[None]


def test_simulate_takes_the_cap_as_a_flag_or_an_override_and_names_it(capsys, tailed_trace):
    import yaml

    from megatron_rl.cli import main

    assert main(["simulate", "--trace", str(tailed_trace), "--max-batch", "8", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["max_batch"] == 8
    assert main(["simulate", "--trace", str(tailed_trace), "max_batch=0", "--print-config"]) == 2
    assert "max_batch: expected >= 1 or null (no cap), got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_batch: expected >= 1 or None"):
        SimConfig(max_batch=0)
    assert main(["simulate", "--trace", str(tailed_trace), "--ranks", "4", "max_batch=2"]) == 0
    out = capsys.readouterr().out
    assert "KV admission: at most 2 requests decoding at once per rank" in out and "cap max_batch=2" in out
    assert main(["simulate", "--trace", str(tailed_trace), "--ranks", "4"]) == 0
    assert "KV admission" not in capsys.readouterr().out


@pytest.mark.parametrize("kv", ["tokens", "paged"])
def test_straggler_migration_moves_only_onto_a_free_slot(kv):
    from elastic.sim.admission import peak_concurrent
    from elastic.sim.replay import make_policy_plan
    from elastic.sim.simulate import _Rollout

    trace, shape = _capped_trace(), ModelShape()
    batch = trace.epoch(1)
    plan = make_policy_plan(Policy("planned", 2), batch, trace.before(1), ranks=4, shape=shape, cost=DEFAULT_COST,
                            kv=kv_unit(kv, 16))
    moved = {}
    for cap in (16, 24):
        sim = _Rollout(plan, batch, DEFAULT_COST, shape, SimConfig(kv=kv, max_batch=cap, migrate_max=16))
        moved[cap] = sim.run().migrated
        assert max(peak_concurrent(sim.at.live)) <= cap
    assert moved[24] > 0 == moved[16]  # at 16 every resident's slots are full
