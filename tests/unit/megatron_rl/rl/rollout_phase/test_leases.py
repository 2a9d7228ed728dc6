"""The trainer's leases on one rank: outcomes a scoring lease finds, and the step's `lease` metrics."""
from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.metrics.keys import grouped
from megatron_rl.rewards import Scorer
from megatron_rl.rl.rollout_phase.leases import TrainingLeases, lease_metrics
from megatron_rl.rollout.engine import Request
from megatron_rl.trainer_config import TrainerConfig


def test_a_scoring_lease_finds_the_reward_phases_outcomes():
    tok, cfg = CharTokenizer(), TrainerConfig()
    prompts = [Prompt("a", "1+1=", "2"), Prompt("b", "2+5=", "7")]
    finished = [Request("a", 0, tok.encode("1+1="), 4, tokens=tok.encode_response("2")),
                Request("b", 1, tok.encode("2+5="), 4, tokens=tok.encode_response("8"))]
    leases = TrainingLeases(cfg, tok, rank=0, world=1).rollout(finished, prompts, fault_here=False)
    leases.pool.jobs[0].run(lambda: False)
    outcomes = leases.outcome().scored
    assert {k: v.outcome for k, v in outcomes.items()} == {("a", 0): "correct", ("b", 1): "wrong"}
    scorer = Scorer(cfg.reward)
    assert [scorer.credit(outcomes[r.key]) for r in finished] == \
           [Scorer(cfg.reward)(tok.decode(r.tokens), p.answer) for r, p in zip(finished, prompts)]
    assert scorer.take_counts()["correct"] == 1


def test_lease_metrics_split_rank_time_and_sum_sidecar_work():
    ledger = {"rank_seconds": {"leased": 3.0, "idle": 1.0}}
    pools = [{"leases": [{}, {}]}, {}, {"leases": [{}]}]
    sidecar = [{"served": 5, "tokens": 20, "restarts": 1, "correct": 3, "distinct": 4}, {},
               {"served": 2, "tokens": 6, "restarts": 0, "correct": 1, "distinct": 4}]
    m = lease_metrics(ledger, pools, sidecar, scored=12)
    assert m == {"leased_rank_s": 3.0, "idle_rank_s": 1.0, "leased_share": 0.75, "leases": 3,
                 "rewards_scored": 12, "sidecar_served": 7, "sidecar_tokens": 26, "sidecar_restarts": 1,
                 "sidecar_queries_answered": 8, "sidecar_accuracy": 0.5}
    assert grouped({"lease": m})["lease/rewards_scored"] == 12
    assert "sidecar_served" not in lease_metrics(ledger, pools, [{}, {}, {}], scored=0)


class _Sidecar:
    """A sidecar job whose work so far is whatever the test says."""

    name = "sidecar"

    def __init__(self):
        self.now = {"served": 3, "tokens": 30, "restarts": 1, "correct": 2, "distinct": 3}

    def report(self) -> dict:
        return dict(self.now)


def test_a_rollouts_leases_count_the_sidecars_work_in_that_rollout():
    from megatron_rl.rollout.leases.jobs import LeaseConfig, RolloutLeases

    sidecar = _Sidecar()
    leases = RolloutLeases.build(LeaseConfig(jobs=["rewards"]), [], lambda r: 1.0, sidecar)
    sidecar.now.update(served=5, tokens=50, correct=3, distinct=4)
    outcome = leases.outcome()
    assert outcome.scored == {}
    # Counts are this rollout's; correct and distinct queries are the sidecar's so far.
    assert outcome.sidecar == {"served": 2, "tokens": 20, "restarts": 0, "correct": 3, "distinct": 4}
    assert [j.name for j in leases.pool.jobs] == ["rewards", "sidecar"]
