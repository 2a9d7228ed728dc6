"""The decode engine's GPU checks (tests/gpu/checks/gpu_decode_checks.py) run small on CPU: the same engine path,
without graphs or the sync debug mode (tests/gpu/test_decode_engine_gpu.py runs them on CUDA)."""
import pytest
import torch

from megatron_rl.models import MoEModelConfig
from tests.gpu.checks import gpu_decode_checks

TINY = MoEModelConfig(num_layers=2, hidden_size=64, num_moe_experts=8, moe_router_topk=2, vocab_size=256)


def test_sync_free_steps_on_cpu():
    out = gpu_decode_checks.sync_free_steps(TINY, device="cpu", dtype=torch.float32, batch=8, steps=2)
    assert out["ok"] and out["evidence"] == {"decode steps": 4}, out


def test_replay_matches_eager_on_cpu():
    out = gpu_decode_checks.replay_matches_eager(TINY, device="cpu", dtype=torch.float32, batch=8)
    assert out["ok"] and out["same"] == out["responses"] == 5, out


@pytest.mark.slow  # two 2-rank rollouts: about 10 s on an idle 2-core machine, 33 s under load
def test_bf16_policies_on_cpu():
    """Check (b)'s bf16 measurement runs on CPU (in bf16 there too; two of its five policies, for
    time: each is a 2-rank rollout); natural floor 1 equals vanilla."""
    out = gpu_decode_checks.bf16_policies(device="cpu", prompts=4, samples=2, policies=gpu_decode_checks.POLICIES[:2])
    assert out["ok"] and set(out["rows"]) == {"natural floor 1"}, out


def test_a_response_may_part_from_the_eager_one_only_at_a_near_tie(monkeypatch):
    """Replay vs eager is margin-aware: parting at the reference's runner-up within NEAR_TIE logit
    standard deviations is a rounding flip; parting at its last choice is not."""
    from tests.gpu.checks.gpu_checks import _model

    model = _model(TINY, 0, torch.float32, "cpu")
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert not gpu_decode_checks._near_tie(model, prompt, [best, 7], [worst, 7])
    monkeypatch.setattr(gpu_decode_checks, "NEAR_TIE", float("inf"))
    assert gpu_decode_checks._near_tie(model, prompt, [best, 7], [worst, 7])


def test_sync_free_steps_fails_on_an_eager_fallback():
    """On CUDA the graphed engine must capture and replay; CPU is an eager fallback, so expecting
    graphs there fails (the check once always returned ok and said "4 replayed")."""
    out = gpu_decode_checks.sync_free_steps(TINY, device="cpu", dtype=torch.float32, batch=8, steps=2, graphs=True)
    assert not out["ok"] and out["evidence"]["graph replays"] == out["evidence"]["graph captures"] == 0, out
    assert "EAGER FALLBACK" in out["summary"]

