"""`train` with `adaptive` migrates live requests, and training stays bit-identical in float64: a
migrated response's recorded sampling log-probs (which the truncated importance weights read) and
its routes (which routing replay reads) travel with it, so the routes and the steps equal vanilla's."""
import pytest
from tiny_train import laddered

from tests.helpers.train import each_policy, rank_results, trainer_config, trainer_step, weights

pytestmark = pytest.mark.timeout(240)


def _cfg(policy: str, data: str):
    from megatron_rl.data.prompts import DataConfig
    from megatron_rl.metrics.wandb_run import LoggingConfig
    from megatron_rl.trainer_config import CheckpointConfig, ElasticConfig, GenerationConfig, GRPOConfig

    return trainer_config(
        vocab_size=20, data=DataConfig(data), grpo=GRPOConfig(group_size=4, micro_batch=8, tis_cap=2.0,
                                                              routing_replay=True),
        generation=GenerationConfig(max_response_len=6), elastic=ElasticConfig(policy=policy),
        checkpoint=CheckpointConfig(every=0, export_hf=False), logging=LoggingConfig(wandb_mode="disabled"),
        steps=1, prompts_per_step=4, ranks=2, dtype="float64", seed=3)


class _Moving:
    """The real online rule, once a request that has tokens (and so log-probs) has moved: until
    then every status check stays, and the first that finds such a request moves it to another
    member (the same decision on every rank, from the same status). So the test never rests on
    whether, or when, the rule chooses to migrate; `moves` counts moves of requests with tokens.
    (The driver hands the rule max(tokens, 1) per request: >= 2 is a request that has tokens.)"""

    def __init__(self, rule):
        self.rule, self.plan, self.moves = rule, rule.plan, 0

    def decide(self, stage, step, rank_of, tokens, done):
        from elastic.planning.online.place import Decision

        d = self.rule.decide(stage, step, rank_of, tokens, done)  # its clocks see every check
        if self.moves:
            self.moves += int(sum(tokens[i] >= 2 for i, _ in d.moves))
            return d
        members = self.plan.stages[stage].members
        for i in range(len(rank_of)):
            if not done[i] and tokens[i] >= 2:
                self.moves += 1
                return Decision(stage, ((i, next(m for m in members if m != rank_of[i])),))
        return Decision(stage)


def _moving(real, rules: list):
    def make(*args, **kwargs):
        rules.append(_Moving(real(*args, **kwargs)))
        return rules[-1]
    return make


def _capture(phase) -> list:
    """The rollout results `phase.run` returns, from now on."""
    results, run = [], phase.run
    phase.run = lambda *a: results.append(run(*a)) or results[-1]
    return results


def _measure(policy, trainer):
    rules: list[_Moving] = []
    routes = _capture(trainer.rollout)
    if policy == "adaptive":
        planner = trainer.rollout.planner
        planner.plan = laddered(planner.plan)
        planner.rule = _moving(planner.rule, rules)
    m = trainer_step(trainer, 1)
    return {"steps": [{k: m[k] for k in ("reward_mean", "loss", "grad_norm", "response_len_mean")}],
            "weights": weights(trainer), "moves": sum(r.moves for r in rules),
            "routes": [r.routes.tolist() for r in routes[0].responses],
            "agreement": m["mismatch"]["router_agreement"]}


def _policies(ctx, data: str, out: str):
    each_policy(ctx, out, {p: _cfg(p, data) for p in ("vanilla", "adaptive")}, _measure)


def test_adaptive_training_migrates_and_equals_vanilla(tmp_path):
    from megatron_rl.data.arith import make_problems, write_jsonl
    from megatron_rl.parallel.launch import run_ranks

    data = tmp_path / "arith.jsonl"
    write_jsonl(make_problems(8, seed=0, max_operand=4, ops="+"), data)
    run_ranks(_policies, 2, str(data), str(tmp_path), timeout_s=120.0)
    for r in rank_results(tmp_path, 2):
        assert r["adaptive"]["moves"] >= 1, "no request moved: the test proves nothing"
        assert r["adaptive"]["steps"] == r["vanilla"]["steps"]
        assert r["adaptive"]["weights"] == r["vanilla"]["weights"]  # float64, bitwise
        assert r["adaptive"]["routes"] == r["vanilla"]["routes"]
        assert r["adaptive"]["agreement"] == r["vanilla"]["agreement"] == 1.0
