"""Partial rollouts' pure rules (elastic/planning/partial.py): carry-over loses and duplicates
nothing over many rollouts, a carried response's tokens are a prefix of its final ones, a group is
trained only when complete, and the pool survives a checkpoint round trip."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.planning.partial import (
    Carried,
    CarryPool,
    PartialRule,
    groups_complete,
    groups_end_step,
)


def _token(rid: int, pos: int) -> int:
    return (rid * 7919 + pos * 104729) % 50021


def _drive(pool: CarryPool, lengths: dict, fresh, rule: PartialRule, check_every: int, rollouts: int,
           snapshots: dict, roundtrip: bool = False):
    """Run `rollouts` rollouts of the pure rules on known lengths; returns the trained groups."""
    trained = []
    for version in range(rollouts):
        if roundtrip:  # a checkpoint between every two rollouts (JSON, as trainer_state.json)
            again = CarryPool(pool.rule, pool.group_size, pool.target)
            again.load_state_dict(json.loads(json.dumps(pool.state_dict())))
            pool = again
        groups = pool.launch(fresh)
        live = [s for g in groups for s in g.live()]
        remaining = {s.key: lengths[s.rid] - s.n for s in live}
        if rule.end == "budget":
            run = {k: min(r, rule.token_budget) for k, r in remaining.items()}
        else:
            done_at = [max((remaining[s.key] - 1 for s in g.live()), default=-1) for g in groups]
            stop = groups_end_step(np.array(done_at), pool.target, check_every)
            run = {k: min(r, stop + 1) for k, r in remaining.items()}
            # The rule's promise: at `stop`, at least `target` launched groups are complete.
            if len(groups) >= pool.target:
                after = [all(remaining[s.key] <= run[s.key] for s in g.live()) for g in groups]
                assert sum(after) >= pool.target
        for s in live:
            n = run[s.key]
            s.extend(n, version, s.n + n >= lengths[s.rid],
                     [_token(s.rid, p) for p in range(s.n, s.n + n)], [-0.1 * p for p in range(s.n, s.n + n)])
        complete_before = sum(g.complete for g in pool.pending)
        out = pool.settle(version)
        pool.check()
        assert len(out.trained) == min(pool.target, complete_before)
        assert all(s.done for g in out.trained for s in g.samples)
        assert out.carried == sum(not s.done for g in pool.pending for s in g.samples)
        assert out.off_policy_tokens <= out.trained_tokens
        trained += out.trained
        for g in pool.pending:
            for s in g.samples:
                snapshots.setdefault(s.rid, []).append(list(s.tokens))
    return trained, pool


@settings(max_examples=60, deadline=None)
@given(group_size=st.integers(2, 4), target=st.integers(1, 5), over=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
       rollouts=st.integers(3, 12), check_every=st.integers(1, 8), prompts=st.integers(1, 6),
       budget=st.one_of(st.none(), st.integers(1, 12)), roundtrip=st.booleans(),
       seed=st.integers(0, 2**16))
def test_carry_over_loses_and_duplicates_nothing(group_size, target, over, rollouts, check_every, prompts,
                                                 budget, roundtrip, seed):
    rng = np.random.default_rng(seed)
    rule = PartialRule(over, "groups") if budget is None else PartialRule(over, "budget", budget)
    pool = CarryPool(rule, group_size, target)
    lengths: dict[int, int] = {}

    def fresh():
        i = 0
        while True:  # a small prompt set: the same prompt is often pending twice
            yield f"p{i % prompts}", 3 + i % 5, {"i": i}
            i += 1

    stream = fresh()
    # Lengths by request id, drawn on demand (long-tailed: a few responses span many rollouts).
    lengths.update(enumerate(np.minimum(1 + rng.pareto(1.2, 10_000) * 4, 60).astype(int).tolist()))
    snapshots: dict[int, list[list[int]]] = {}
    trained, pool = _drive(pool, lengths, stream, rule, check_every, rollouts, snapshots, roundtrip)
    launched = pool.next_uid
    uids = [g.uid for g in trained] + [g.uid for g in pool.pending]
    assert sorted(uids) == list(range(launched)), "a group was lost or duplicated"
    assert pool.dropped() == 0
    finals = {}
    for g in trained:
        assert [s.sample for s in g.samples] == list(range(group_size))
        for s in g.samples:
            assert s.n == lengths[s.rid] == len(s.tokens) == len(s.logprobs) == sum(n for _, n in s.segments)
            assert s.tokens == [_token(s.rid, p) for p in range(s.n)]
            versions = s.versions()
            assert versions == sorted(versions) and len(versions) == s.n
            finals[s.rid] = s.tokens
    for g in pool.pending:
        for s in g.samples:
            finals[s.rid] = s.tokens
    for rid, snaps in snapshots.items():
        final = finals[rid]
        for snap in snaps:
            assert final[:len(snap)] == snap, f"carried tokens of {rid} are not a prefix of its final ones"


def test_the_roundtrip_changes_nothing():
    rule, lengths = PartialRule(0.5), {rid: 1 + (rid * 37) % 23 for rid in range(1000)}
    runs = []
    for roundtrip in (False, True):
        stream = ((f"p{i % 3}", 4, i) for i in range(10_000))
        trained, pool = _drive(CarryPool(rule, 3, 2), lengths, stream, rule, 4, 8, {}, roundtrip)
        runs.append(([(g.uid, [s.tokens for s in g.samples], [s.segments for s in g.samples]) for g in trained],
                     [g.uid for g in pool.pending]))
    assert runs[0] == runs[1]
    assert runs[0][1], "the run ended with nothing pending: the round trip carried nothing over"


def test_off_policy_share_and_lag_count_the_older_versions():
    pool = CarryPool(PartialRule(0.0), group_size=2, target=1)
    (g,) = pool.launch(iter([("a", 5, None)]))
    g.samples[0].extend(3, 0, True)
    g.samples[1].extend(2, 0, False)  # carried
    assert pool.settle(0).trained == [] and pool.pending == [g]
    (again,) = pool.launch(iter(()))
    assert again is g
    g.samples[1].extend(4, 2, True)  # resumed under version 2
    out = pool.settle(2)
    assert [x.uid for x in out.trained] == [g.uid]
    assert (out.trained_tokens, out.off_policy_tokens, out.max_version_lag) == (9, 5, 2)
    assert g.samples[1].versions() == [0, 0, 2, 2, 2, 2]


def test_groups_end_step_and_count():
    assert groups_end_step(np.array([-1, 3, 10, 40]), 2, 4) == 4  # second-earliest group ends at 3
    assert groups_end_step(np.array([-1, -1, 10]), 2, 4) == 0
    assert groups_end_step(np.array([5, 9]), 3, 4) == 9  # fewer groups than the target: run to the end
    assert groups_complete(np.array([0, 2, 0, 1])) == 2


def test_rule_refuses_bad_settings():
    with pytest.raises(ValueError, match="over_sample"):
        PartialRule(-0.1)
    with pytest.raises(ValueError, match="token_budget"):
        PartialRule(0.2, "budget")
    with pytest.raises(ValueError, match="end"):
        PartialRule(0.2, "tokens")
    assert PartialRule(0.25).launch_count(128) == 160 and PartialRule(0.0).launch_count(7) == 7
    c = Carried("a", 0, 3, 0)
    c.extend(2, 0, True)
    with pytest.raises(ValueError, match="complete"):
        c.extend(1, 1, True)
