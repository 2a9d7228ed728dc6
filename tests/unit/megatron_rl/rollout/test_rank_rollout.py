"""One rank's rollout (rollout/rank_rollout.py) without a world: the requests a rank takes, and the
gathered result's requests by key."""
import pytest
import torch

from elastic.ledger import RankLedger
from elastic.planning.plan import Assignment, static_plan
from elastic.runtime.runtime import RankOutcome
from megatron_rl.parallel.launch import ParallelContext
from megatron_rl.rollout.engine import Request
from megatron_rl.rollout.leases.jobs import LeaseOutcome
from megatron_rl.rollout.rank_rollout import Generated, RankResult, RankRollout, RolloutResult


def _rollout(rank: int) -> RankRollout:
    plan = static_plan("natural", [Assignment("b", 0, 1), Assignment("a", 1, 0), Assignment("a", 0, 1)], 2, 8)
    return RankRollout(plan, None, ParallelContext(rank, 2, 60.0, None, torch.device("cpu")), backend=None)


def test_a_rank_takes_its_requests_in_plan_order_fresh():
    caller = [Request("a", 0, [1, 2], 4, tokens=[7]), Request("a", 1, [1, 2], 4), Request("b", 0, [3], 4)]
    mine = _rollout(1).mine(caller)
    assert [r.key for r in mine] == [("b", 0), ("a", 0)]
    assert mine[1].tokens == [] and mine[1].prompt == [1, 2]  # the engine appends to a copy
    assert caller[0].tokens == [7] and all(r is not c for r in mine for c in caller)
    assert [r.key for r in _rollout(0).mine(caller)] == [("a", 1)]


def _rank(rank: int, finished: list[str], unfinished: list[str]) -> RankResult:
    def gen(pid: str, done: bool) -> Generated:
        return Generated(pid, 0, [5] * len(pid), done)
    return RankResult(RankOutcome(RankLedger(rank), 3, 0, None, 0.1), [gen(p, True) for p in finished],
                      [gen(p, False) for p in unfinished], {}, LeaseOutcome())


def test_the_result_holds_every_request_once_by_key():
    result = RolloutResult([_rank(0, ["a", "bb"], ["ccc"]), _rank(1, ["d"], [])], ledger=None)
    got = result.requests()
    assert sorted(got) == [("a", 0), ("bb", 0), ("ccc", 0), ("d", 0)]
    assert not got["ccc", 0].finished and got["d", 0].finished
    assert [g.prompt_id for g in result.finished()] == ["a", "bb", "d"]
    assert [r.tokens for r in result.ranks] == [6, 1]
    with pytest.raises(AssertionError, match="duplicated"):
        RolloutResult([_rank(0, ["a"], []), _rank(1, [], ["a"])], ledger=None).requests()
