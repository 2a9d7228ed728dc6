"""Training on the length-tailed counting task (examples/tiny_cpu_tailed.yaml's, tiny): `vanilla`,
`planned` and `adaptive` train bit-identically in float64, and every step's rollout ledger holds
all of its rank-time: W x ticks rank-steps, W x T rank-seconds (to the ledger's 1%: ranks' clocks differ)."""
import pytest
from tiny_train import TINY_TRAIN, laddered, tiny_train_config

from tests.helpers.train import each_policy, rank_results, trainer_step, weights

pytestmark = pytest.mark.timeout(300)
POLICIES = ("vanilla", "planned", "adaptive")
# What training sees; the ledger, timings, placement and stages are the rollout's own.
LEARNING = ("reward_mean", "reward_std", "reward_outcomes", "loss", "grad_norm", "response_len_mean",
            "response_tokens")
STEPS = 2


def _measure(policy, trainer):
    if policy == "adaptive":  # a random policy's lengths carry no per-prompt signal: the
        trainer.rollout.planner.plan = laddered(trainer.rollout.planner.plan)  # offline plan would keep every rank
    steps = []
    for step in range(1, STEPS + 1):
        m = trainer_step(trainer, step)
        secs, ticks = m["rank_seconds"], m["rank_steps"]
        steps.append({"learning": {k: m[k] for k in LEARNING}, "final_stage": m["final_stage"],
                      "placement": m["placement"],
                      "seconds": [sum(secs.values()), trainer.world * m["rollout_time_s"]],
                      "ticks": [sum(ticks.values()), trainer.world * m["rollout_steps"]]})
    return {"steps": steps, "weights": weights(trainer)}


def _policies(ctx, cfg_path: str, out: str):
    from megatron_rl.config import load_dataclass
    from megatron_rl.trainer_config import TrainerConfig

    each_policy(ctx, out, {p: load_dataclass(TrainerConfig, cfg_path, {"elastic.policy": p}) for p in POLICIES},
                _measure)


def test_tailed_training_is_bit_identical_across_policies_and_conserves_the_ledger(tmp_path):
    from megatron_rl.data.arith import write_jsonl
    from megatron_rl.data.count import ALPHABET, make_count_problems
    from megatron_rl.parallel.launch import run_ranks

    data = tmp_path / "count.jsonl"
    write_jsonl(make_count_problems(8, seed=0, max_value=20, max_span=6, long_share=0.3), data)
    cfg = tiny_train_config(
        tmp_path, model={**TINY_TRAIN["model"], "vocab_size": 3 + len(ALPHABET), "max_position_embeddings": 64},
        tokenizer={"alphabet": ALPHABET}, data={"path": str(data)}, generation={"max_response_len": 24},
        elastic={"floor": 1, "shrink_cost_s": 1e-6}, grpo={"group_size": 4, "micro_batch": 8, "tis_cap": 2.0},
        steps=STEPS, dtype="float64", logging={"wandb_mode": "disabled"})
    run_ranks(_policies, 2, str(cfg), str(tmp_path / "out"), timeout_s=240.0)
    for r in rank_results(tmp_path / "out", 2):
        for policy in POLICIES:
            for s in r[policy]["steps"]:
                assert s["seconds"][0] == pytest.approx(s["seconds"][1], rel=0.01), (policy, s)
                assert s["ticks"][0] == s["ticks"][1], (policy, s)
            assert [s["learning"] for s in r[policy]["steps"]] == [s["learning"] for s in r["vanilla"]["steps"]]
            assert r[policy]["weights"] == r["vanilla"]["weights"], policy  # float64, bitwise
        assert any(s["final_stage"] > 0 for s in r["adaptive"]["steps"]), \
            "adaptive never shrank: the test proves little"
        assert any(p["placement"] != v["placement"] for p, v in zip(r["planned"]["steps"], r["vanilla"]["steps"])), \
            "planned placed every response where vanilla did: the test proves little"
