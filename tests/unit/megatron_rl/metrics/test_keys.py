"""The grouped metric names: the table in megatron_rl/metrics/keys.py and docs/training.md agree."""
from fnmatch import fnmatch

from conftest import documented_keys

from megatron_rl.metrics.keys import KEYS, PHASES, grouped, numeric


def test_every_grouped_key_is_documented():
    documented = documented_keys()
    sample = {raw: ({"x": 1.0} if raw in ("reward_outcomes", "rank_seconds", "rank_steps", "shrink_latency_s",
                                          "lease", "pool", "val", "partial", "reward_extra") else 1.0)
              for raw in KEYS}
    sample["advantages"] = {"mean": 0.0, "max": 1.0, "min": -1.0}
    sample["prompt_len"] = {"mean": 5.0, "max": 6}
    sample["per_token_ms"] = {"rollout": 1.0, "update": 1.0}
    sample["val_core"] = {"gsm8k": {"reward": {"mean@4": 0.5, "best@4/mean": 1.0, "maj@4/mean": 0.5}}}
    sample["phase_s"] = {p: 1.0 for p in PHASES}
    sample["stages"] = [[0, 1], [0]]
    sample["lease_jobs"] = 2
    sample["val"] = {"pass@1": 0.5, "reward_mean": 0.5, "response_len_mean": 2.0, "prompts": 41}
    from megatron_rl.rl.update.mismatch import MismatchTally  # what PolicyUpdate.update reports

    sample["mismatch"] = {**MismatchTally("cpu").finish(1), "logp_abs_diff_mean": 0.0, "logp_abs_diff_max": 0.0}
    names = set(grouped(sample))
    missing = sorted(n for n in names if not any(fnmatch(n, d) for d in documented))
    assert not missing, f"docs/training.md's metrics table lacks {missing}"
    assert {"timing_s/gen", "actor/lr", "lease/jobs", "elastic/num_stages", "elastic/floor_ranks"} <= names


def test_grouping_renames_phases_and_keeps_unknown_keys():
    flat = grouped({"reward_mean": 0.5, "phase_s": {"rollout": 2.0, "update": 1.0}, "brand_new": 3,
                    "rank_seconds": {"dummy": 1.5}, "lease": {"jobs": 2}, "layout": "natural"})
    assert flat == {"reward/mean": 0.5, "critic/score/mean": 0.5, "timing_s/gen": 2.0,
                    "timing_s/update_actor": 1.0, "brand_new": 3,
                    "elastic/rank_seconds/dummy": 1.5, "lease/jobs": 2, "elastic/layout": "natural"}
    assert numeric(flat) == {k: float(v) for k, v in flat.items() if k != "elastic/layout"}


def test_verl_names_stand_beside_ours():
    flat = grouped({"reward_mean": 0.5, "loss": 0.1, "clip_frac": 0.2, "global_step": 3,
                    "per_token_ms": {"rollout": 2.0, "update": 1.0}, "advantages": {"mean": 0.0}})
    assert flat["critic/score/mean"] == flat["reward/mean"] == 0.5
    assert flat["actor/pg_loss"] == flat["actor/loss"] and flat["actor/pg_clipfrac"] == flat["actor/clip_frac"]
    assert flat["timing_per_token_ms/gen"] == 2.0 and flat["timing_per_token_ms/update_actor"] == 1.0
    assert flat["training/global_step"] == 3 and flat["critic/advantages/mean"] == 0.0
