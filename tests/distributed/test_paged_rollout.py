"""The paged KV cache on 4 gloo ranks: planned (ranks leave) and adaptive (requests migrate with
their pages) rollouts give the slot cache's responses bit for bit in float64, each rank prefills a
GRPO group's prompt once, and a pool too small for the longest request stops before any rank starts."""
import pytest

from megatron_rl.config import load_dataclass
from megatron_rl.errors import FlexFloorError
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout_runner import prepare, run_rollouts

BASE = {"batch.prompts": 8, "batch.samples": 4, "batch.length_scale": 0.01, "ranks": 4,
        "sampling.greedy": False, "sampling.temperature": 0.8, "sampling.top_p": 0.9, "timeout_s": 60.0}
PAGED = {"kv": "paged", "kv_page_size": 2}  # two positions a page: the tiny prompts fill whole pages


@pytest.mark.timeout(600)
def test_paged_planned_and_adaptive_equal_the_slot_cache():
    cfgs = [load_dataclass(RolloutConfig, None, {**BASE, **o}) for o in (
        {"policy": "vanilla", "kv": "slots"}, {"policy": "planned", "floor": 1, **PAGED},
        {"policy": "adaptive", "floor": 1, **PAGED})]
    runs = run_rollouts(cfgs, quiet=True)
    slots, planned, adaptive = (r.report for r in runs)
    responses = runs[2].responses
    assert len({(r["prompt_id"], r["sample"]) for r in responses}) == len(responses) == 32
    assert planned["responses_sha256"] == adaptive["responses_sha256"] == slots["responses_sha256"]
    assert planned["final_stage"] > 0 and adaptive["migrated"] > 0, "no rank left, no request moved"
    assert slots["kv"]["cache"] == "slots" and slots["kv"]["pages_shared"] == 0
    for paged in (planned, adaptive):
        kv = paged["kv"]
        assert kv["cache"] == "paged" and kv["prefill_tokens_requested"] == slots["kv"]["prefill_tokens_requested"]
        assert kv["prefill_tokens_computed"] < kv["prefill_tokens_requested"] and kv["pages_shared"] > 0


def test_a_pool_smaller_than_the_longest_request_stops_before_the_ranks():
    cfg = load_dataclass(RolloutConfig, None, {**BASE, **PAGED, "kv_pages": 2})
    with pytest.raises(FlexFloorError, match=r"kv_pages 2: expected a pool of at least \d+ positions \(response \S+ "
                                                 r"needs them\), got 4"):
        prepare(cfg)
