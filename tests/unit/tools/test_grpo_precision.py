"""The CPU side of the bf16 GRPO row (tools/grpo_precision.py): bf16 and fp32 updates on the same
rollouts, each with its per-update figures, on a tiny model."""

import pytest

from tests.gpu.checks import gpu_checks
from tools import grpo_precision

TINY = gpu_checks.TINY_QWEN3_MOE


@pytest.mark.timeout(300)
def test_both_precisions_update_on_the_same_rollouts_with_their_figures():
    out = grpo_precision.compare(mcfg=TINY, steps=1, prompts_per_step=2, group_size=4, max_response_len=6)
    (row,) = out["rows"]
    for name in ("bf16", "fp32"):
        c = row[name]
        assert set(c) == set(grpo_precision.COLUMNS)
        assert c["update_rel"] > 0 and 0 < c["update_changed"] <= 1 and c["grad_norm"] > 0
        assert c["after"] < c["before"] and c["kl_after"] > 0
    # the same rollout: the same responses priced by both (their old log-probs differ by precision only)
    assert row["bf16"]["rollout_gap"] < 0.1 and row["fp32"]["rollout_gap"] < 0.1
    assert row["bf16"]["update_changed"] < row["fp32"]["update_changed"]  # bf16 rounds small steps away
    table = grpo_precision.table(out["rows"])
    assert "bf16 update, fp32 judge" in table and grpo_precision.summary(out["rows"]).startswith("1: ")


def _row(before16, after16, kl16, before32, after32, signal=True):
    cols = dict.fromkeys(grpo_precision.COLUMNS, 0.0)
    return {"signal": signal, "bf16": {**cols, "before": before16, "after": after16, "kl_after": kl16},
            "fp32": {**cols, "before": before32, "after": after32}}


def test_the_verdict_needs_descent_inside_the_trust_region_and_agreement_with_fp32():
    # step 4 of the lr 1e-3 CPU run (docs/gpu.md): both precisions raise the surrogate, KL 2.98
    assert not grpo_precision.verdict([_row(0.0, 0.1953, 2.98, 0.0, 0.1982)])
    # a descent far outside the trust region says nothing either
    assert not grpo_precision.verdict([_row(0.0, -0.11, 15.4, 0.0, -0.11)])
    # inside it, bf16 must drop the surrogate as fp32 does on the same rollout
    assert grpo_precision.verdict([_row(0.0, -0.05, 0.1, 0.0, -0.051)])
    assert not grpo_precision.verdict([_row(0.0, -0.01, 0.1, 0.0, -0.05)])
    assert not grpo_precision.verdict([_row(0.0, 0.0, 0.0, 0.0, 0.0, signal=False)])  # nothing judged
