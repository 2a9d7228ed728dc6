"""Property tests of the planner's output over random batches, rank and expert counts, budgets.

Every plan the planner returns must be safe; every input it cannot make safe must be rejected with
a `PlanError` that says why. Memory is re-checked here from first principles: expert bytes per
member per stage, and, with exact lengths (the oracle), each rank's true KV peak.
"""
import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic.planning.chains.schedule import contiguous_owners, held_counts
from elastic.planning.choices import PlanChoices
from elastic.planning.dims import planned_dims
from elastic.planning.layout import LAYOUTS, layout_kind, natural
from elastic.planning.memory.kv_unit import kv_unit
from elastic.planning.plan import PlanError
from elastic.planning.planner import make_plan
from elastic.planning.platform import Platform
from elastic.planning.shape import ModelShape
from elastic.sim.synth import generate, preset
from elastic.trace import Trace, TraceRecord

KV_BYTES = 64


def tiny_shape(experts: int, expert_slots: int, kv_tokens: int) -> ModelShape:
    """A CPU-sized model whose ranks hold `expert_slots` experts beside `kv_tokens` of KV."""
    base = ModelShape(name="tiny", num_experts=experts, topk=min(2, experts), num_layers=2,
                      hidden_size=16, expert_ffn=8, kv_bytes_per_token=KV_BYTES,
                      dense_bytes=1000, memory_per_rank_bytes=1, memory_utilization=1.0)
    mem = base.dense_bytes + expert_slots * base.expert_bytes + kv_tokens * KV_BYTES
    return ModelShape(**{**base.to_dict(), "memory_per_rank_bytes": mem})


@st.composite
def problems(draw):
    ranks = draw(st.integers(1, 12))
    experts = draw(st.integers(4, 40))
    floor = draw(st.integers(1, ranks))
    prompts = draw(st.integers(1, 10))
    samples = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 400), min_size=prompts * samples,
                            max_size=prompts * samples))
    prompt_lens = draw(st.lists(st.integers(1, 60), min_size=prompts, max_size=prompts))
    slots = draw(st.integers(0, experts + 2))
    kv_tokens = draw(st.integers(0, 6000))
    layout = draw(st.sampled_from(["natural", "lengthsort", "planned"]))
    batch = [TraceRecord(f"q{p}", 1, s, prompt_lens[p], lengths[p * samples + s])
             for p in range(prompts) for s in range(samples)]
    return ranks, experts, floor, batch, tiny_shape(experts, slots, kv_tokens), layout


def _true_peak(items):
    """Exact KV peak (tokens) of concurrent responses (prompt, length) freed when they end."""
    peak, prompts = 0, 0
    for k, (L, p) in enumerate(sorted(items, reverse=True), start=1):
        prompts += p
        peak = max(peak, prompts + k * L)
    return peak


def _check_safe(plan, batch, shape, floor, ranks, lengths=None):
    keys = [r.key for r in batch]
    placed = [(a.prompt_id, a.sample) for a in plan.assignments]
    assert sorted(placed) == sorted(keys)  # every response exactly once
    assert plan.stages[0].members == tuple(range(ranks))
    assert plan.stages[0].owners == contiguous_owners(shape.num_experts, range(ranks))
    assert len(plan.stages[-1].members) >= floor
    prev = None
    for st_ in plan.stages:
        members = set(st_.members)
        if prev is not None:
            assert members < prev and (prev - members) <= set(st_.drained)
        assert set(st_.owners) == set(range(shape.num_experts))
        for rs in st_.owners.values():
            assert rs and set(rs) <= members
        held = held_counts(st_.owners, st_.members)
        for r, h in held.items():
            assert shape.dense_bytes + h * shape.expert_bytes <= shape.usable_bytes
            if lengths is not None:
                mine = [(lengths[(a.prompt_id, a.sample)], p_len[(a.prompt_id, a.sample)])
                        for a in plan.assignments if a.rank == r
                        for p_len in [{x.key: x.prompt_len for x in batch}]]
                assert _true_peak(mine) * KV_BYTES <= shape.kv_budget_bytes(h)
        prev = members
    plan.check(keys)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_oracle_plans_are_safe_or_rejected_with_a_reason(problem):
    ranks, experts, floor, batch, shape, layout = problem
    lengths = {r.key: r.response_len for r in batch}
    try:
        plan = make_plan(batch, Trace([]), platform=Platform(planned_dims(ranks, shape.num_experts), shape),
                         choices=PlanChoices(floor, False), layout=layout, true_lengths=lengths)
    except PlanError as e:
        msg = str(e)
        held_floor = math.ceil(experts / floor)
        if shape.kv_budget_bytes(held_floor) <= 0:
            assert f"floor {floor} cannot hold the {experts} experts" in msg
        else:
            assert "KV cache" in msg, msg
            # Never rejected when one rank of the full world could hold the whole batch with room
            # to spare (the planner's KV model is conservative, but not by half).
            held0 = max(held_counts(contiguous_owners(experts, range(ranks)), range(ranks)).values())
            whole = _true_peak([(r.response_len, r.prompt_len) for r in batch])
            assert 1.5 * whole * KV_BYTES > shape.kv_budget_bytes(held0), msg
        return
    _check_safe(plan, batch, shape, floor, ranks, lengths)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 16), st.integers(4, 64), st.data())
def test_predicted_plans_are_safe(ranks, experts, data):
    floor = data.draw(st.integers(1, ranks))
    layout = data.draw(st.sampled_from(["natural", "lengthsort", "planned"]))
    tailguard = data.draw(st.booleans())
    trace = generate(preset("deepscaler", prompts=data.draw(st.integers(2, 12)), samples=4,
                            epochs=3, cap=4096), seed=data.draw(st.integers(0, 99)))
    shape = tiny_shape(experts, experts, data.draw(st.integers(20000, 400000)))
    batch = trace.epoch(2)
    try:
        plan = make_plan(batch, trace.before(2), platform=Platform(planned_dims(ranks, shape.num_experts), shape),
                         choices=PlanChoices(floor, tailguard), layout=layout)
    except PlanError as e:
        assert "KV cache" in str(e)
        return
    _check_safe(plan, batch, shape, floor, ranks)


def test_floor_that_cannot_hold_the_experts_is_rejected():
    batch = [TraceRecord("a", 0, 0, 10, 10)]
    shape = tiny_shape(16, 7, 0)  # a rank fits 7 experts and nothing else: floor 2 would need 8
    with pytest.raises(PlanError, match="floor 2 cannot hold the 16 experts"):
        make_plan(batch, Trace([]), platform=Platform(planned_dims(4, shape.num_experts), shape),
                  choices=PlanChoices(2, False), layout="planned", true_lengths={("a", 0): 10})
    plan = make_plan(batch, Trace([]), platform=Platform(planned_dims(4, shape.num_experts), shape),
                     choices=PlanChoices(3, False), layout="planned", true_lengths={("a", 0): 10})
    assert len(plan.stages[-1].members) >= 3


def test_kv_that_cannot_fit_is_rejected():
    batch = [TraceRecord("a", 0, s, 10, 5000) for s in range(4)]
    shape = tiny_shape(8, 8, 12_000)  # two of these responses fit a rank, not three
    lengths = {r.key: 5000 for r in batch}
    for layout in ("natural", "lengthsort", "planned"):
        with pytest.raises(PlanError, match="KV cache"):
            make_plan(batch, Trace([]), platform=Platform(planned_dims(1, shape.num_experts), shape),
                      choices=PlanChoices(1, False), layout=layout, true_lengths=lengths)
    plan = make_plan(batch, Trace([]), platform=Platform(planned_dims(2, shape.num_experts), shape),
                     choices=PlanChoices(1, False), layout="planned", true_lengths=lengths)
    _check_safe(plan, batch, shape, 1, 2, lengths)


@pytest.mark.parametrize("kv,ranks", [(kv_unit("tokens"), 2), (kv_unit("paged", 16), 1), (kv_unit("slots"), 2),
                                      (kv_unit("paged", 4096), 4)])
def test_kv_is_priced_in_the_positions_the_runs_cache_holds(kv, ranks):
    # Four samples of one 5,000-token prompt with empty responses, 12,000 positions a rank. Tokens
    # and slots (5,002 positions each) fit two a rank; pages of 16 hold the prompt's 312 full pages
    # once and a 16-position page of each sample's own, all four on one rank; pages of 4,096 hold
    # the one full prompt page once and a page of each sample's own (4,096 + 2 x 4,096 > 12,000):
    # one a rank.
    batch = [TraceRecord("a", 0, s, 5000, 0) for s in range(4)]
    shape = tiny_shape(8, 8, 12_000)
    budget = replace(shape.budget, kv=kv)
    lengths = {r.key: 0 for r in batch}
    for fewer in range(1, ranks):
        if not kv.queues:
            with pytest.raises(PlanError, match="KV cache cannot fit"):
                make_plan(batch, Trace([]),
                          platform=Platform(planned_dims(fewer, shape.num_experts), shape, budget=budget),
                          choices=PlanChoices(1, False), layout="planned", true_lengths=lengths)
            continue
        # Slots and pages queue what does not fit: planned, every rank staying, and said.
        plan = make_plan(batch, Trace([]),
                         platform=Platform(planned_dims(fewer, shape.num_experts), shape, budget=budget),
                         choices=PlanChoices(1, False), layout="planned", true_lengths=lengths)
        assert "queue what does not fit" in plan.meta["kv_queued"] and len(plan.stages) == 1
    plan = make_plan(batch, Trace([]), platform=Platform(planned_dims(ranks, shape.num_experts), shape, budget=budget),
                     choices=PlanChoices(ranks, False), layout="planned", true_lengths=lengths)
    assert len(plan.assignments) == 4 and "kv_queued" not in plan.meta


@pytest.mark.parametrize("kv", [kv_unit("slots"), kv_unit("paged", 16)])
def test_a_response_no_rank_holds_alone_is_refused_even_by_a_queueing_cache(kv):
    batch = [TraceRecord("a", 0, 0, 13_000, 0)]  # 13,000 positions; a rank has 12,000
    shape = tiny_shape(8, 8, 12_000)
    with pytest.raises(PlanError, match="KV cache"):
        make_plan(batch, Trace([]),
                  platform=Platform(planned_dims(2, shape.num_experts), shape, budget=replace(shape.budget, kv=kv)),
                  choices=PlanChoices(1, False), layout="planned", true_lengths={("a", 0): 0})


def test_a_huge_prompt_with_short_responses_is_rejected():
    # Prompt KV is held from prefill on, however short the response: 10 million prompt tokens
    # never fit, whatever the lengths or their prediction say.
    history = Trace([TraceRecord("a", 0, s, 10_000_000, 10) for s in range(4)])
    batch = [TraceRecord("a", 1, s, 10_000_000, 10) for s in range(4)]
    shape = tiny_shape(8, 8, 100_000)
    for kw in ({"true_lengths": {r.key: 10 for r in batch}}, {}):
        for layout in ("natural", "lengthsort", "planned"):
            with pytest.raises(PlanError, match="KV cache cannot fit"):
                make_plan(batch, history, platform=Platform(planned_dims(2, shape.num_experts), shape),
                          choices=PlanChoices(1, True), layout=layout, **kw)
    with pytest.raises(PlanError, match=r"alone needs up to 100000\d\d KV tokens \(its prompt is "
                                        r"10000000\)"):
        make_plan(batch, history, platform=Platform(planned_dims(2, shape.num_experts), shape),
                  choices=PlanChoices(1, False), layout="lengthsort", true_lengths={r.key: 10 for r in batch})


@pytest.mark.parametrize("tailguard", [False, True])
@pytest.mark.parametrize("layout", ["natural", "lengthsort", "planned"])
def test_every_prompt_is_counted_not_its_expectation(layout, tailguard):
    # History of 1- or 50-token responses: the predictive distribution leaves ~8% of its mass
    # below one token. All 200 prompts are prefilled at once (200 x 1,001 KV tokens), so a budget
    # of 195,000 must be rejected although the expected demand (~190,500) is below it.
    rng = random.Random(0)
    history = Trace([TraceRecord(f"q{p}", e, s, 1000, rng.choice([1, 50]))
                     for e in range(2) for p in range(50) for s in range(4)])
    batch = [TraceRecord(f"q{p}", 2, s, 1000, 1) for p in range(50) for s in range(4)]
    with pytest.raises(PlanError, match="KV cache cannot fit"):
        make_plan(batch, history,
                  platform=Platform(planned_dims(1, tiny_shape(8, 8, 195_000).num_experts), tiny_shape(8, 8, 195_000)),
                  choices=PlanChoices(1, tailguard), layout=layout)
    make_plan(batch, history,
              platform=Platform(planned_dims(1, tiny_shape(8, 8, 205_000).num_experts), tiny_shape(8, 8, 205_000)),
              choices=PlanChoices(1, tailguard), layout=layout)


def test_empty_responses_hold_their_prompts():
    batch = [TraceRecord("a", 0, s, 5000, 0) for s in range(4)]
    shape = tiny_shape(8, 8, 12_000)  # two prompts fit a rank, not four
    lengths = {r.key: 0 for r in batch}
    with pytest.raises(PlanError, match="KV cache cannot fit"):
        make_plan(batch, Trace([]), platform=Platform(planned_dims(1, shape.num_experts), shape),
                  choices=PlanChoices(1, False), layout="planned", true_lengths=lengths)
    plan = make_plan(batch, Trace([]), platform=Platform(planned_dims(2, shape.num_experts), shape),
                     choices=PlanChoices(1, False), layout="planned", true_lengths=lengths)
    _check_safe(plan, batch, shape, 1, 2, lengths)


def test_empty_history_needs_the_cap():
    batch = [TraceRecord("a", 0, 0, 10, 10)]
    shape = tiny_shape(8, 8, 10_000)
    with pytest.raises(PlanError, match="max_response_len"):
        make_plan(batch, Trace([]), platform=Platform(planned_dims(2, shape.num_experts), shape),
                  choices=PlanChoices(1, True), layout="natural")
    plan = make_plan(batch, Trace([]), platform=Platform(planned_dims(2, shape.num_experts), shape),
                     choices=PlanChoices(1, True), layout="natural", max_response_len=100)
    assert [a.rank for a in plan.assignments] == [a.rank for a in natural([("a", 0)], 2)]


@pytest.mark.parametrize("ranks, experts", [(1, 4), (3, 4), (7, 256), (256, 4), (256, 256)])
def test_extreme_rank_and_expert_counts(ranks, experts):
    trace = generate(preset("eurus", prompts=64, samples=8, epochs=2), seed=0)
    shape = tiny_shape(experts, experts, 10**7)
    plan = make_plan(trace.epoch(1), trace.before(1), platform=Platform(planned_dims(ranks, shape.num_experts), shape),
                     choices=PlanChoices(1, True), layout="planned")
    _check_safe(plan, trace.epoch(1), shape, 1, ranks)


def test_layout_kinds_say_how_each_layout_places():
    # The baselines place once before any shrink; `planned` places per chain and, on a weak
    # predictor, as `lengthsort`; an unknown name is refused naming the layouts.
    assert [layout_kind(n).place_once is None for n in LAYOUTS] == [False, False, True]
    assert [layout_kind(n).placed_as(weak=True) for n in LAYOUTS] == ["natural", "lengthsort", "lengthsort"]
    assert [layout_kind(n).placed_as(weak=False) for n in LAYOUTS] == list(LAYOUTS)
    with pytest.raises(PlanError, match="expected one of natural, lengthsort, planned, got 'rows'"):
        layout_kind("rows")
