"""`flexfloor train` with `partial:` as a user runs it: responses are carried over and resumed,
none is dropped, and a resume from a checkpoint continues the carried ones exactly, their recorded
routes included (routing replay on); a tampered carried route is refused naming file and field."""
import json
import shutil

import pytest
import yaml

from tests.helpers.train import learning, metrics, train
from tests.tiny_train import rehash

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
LEARNING = ("reward/", "response_length/", "actor/", "partial/", "mismatch/")

# A short warm start gives a policy that sometimes ends at EOS and sometimes runs on: response
# lengths vary, so some groups complete before others and the end rule leaves responses unfinished.
CONFIG = {
    "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
              "kv_channels": 8, "num_moe_experts": 8, "moe_router_topk": 2,
              "moe_ffn_hidden_size": 16, "vocab_size": 20},
    "grpo": {"group_size": 4, "micro_batch": 8, "tis_cap": 2.0, "routing_replay": True},
    "optim": {"lr": 0.003},
    "generation": {"max_response_len": 8},
    "warmstart": {"sft_steps": 30, "prompts_per_step": 16},
    "checkpoint": {"every": 1, "export_hf": False},
    "logging": {"wandb_mode": "disabled"},
    "partial": {"enabled": True, "over_sample": 1.0},
    "steps": 2, "prompts_per_step": 4, "seed": 5, "dtype": "float64", "ranks": 2,
}


def test_partial_training_carries_resumes_and_drops_nothing(tmp_path):
    from megatron_rl.data.arith import make_problems, write_jsonl

    write_jsonl(make_problems(40, seed=0, max_operand=9, ops="+"), tmp_path / "arith.jsonl")
    config = tmp_path / "partial.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "data": {"path": str(tmp_path / "arith.jsonl")}}))
    full = tmp_path / "full"
    train(config, full)
    steps = metrics(full)
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["partial/dropped"] == 0 for m in steps)
    assert sum(m["partial/carried"] for m in steps) > 0, "nothing was carried over: the test proves nothing"
    resumed_steps = [m for m in steps if m["partial/max_version_lag"] >= 1]
    assert resumed_steps and all(0 < m["partial/off_policy_token_share"] <= 1 for m in resumed_steps)
    # Every group launched so far has trained (4 a step) or is pending: none lost or duplicated.
    assert all(m["partial/launched_groups"] == 4 * m["step"] + m["partial/pending_groups"] for m in steps)
    state = json.loads((full / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    carried = [s for g in state["partial"]["pool"]["pending"] for s in g["samples"] if not s["done"] and s["n"]]
    assert carried, "step 1's checkpoint holds no partly generated response"
    assert {(p, r) for p, r, _ in state["partial"]["routes"]} >= {(s["prompt_id"], s["rid"]) for s in carried}
    assert all(m["mismatch/rows_without_routes"] == 0 for m in steps)

    # Resume from step 1 (as after a crash before step 2's save): the carried responses continue.
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_000002")
    (part / "checkpoints" / "latest").write_text("step_000001")
    # Partial off would drop the carried groups: refused before any rank starts
    off = train(config, part, "partial.enabled=false", expect=2)
    assert off.stderr.count("\n") == 1, off.stderr
    assert "trainer_state.json: partial: " in off.stderr and "partial.drop_carried=true" in off.stderr
    proc = train(config, part)
    assert "resuming from" in proc.stderr
    a, b = metrics(full)[1], metrics(part)[1]
    assert learning(a, LEARNING) == learning(b, LEARNING)

    # A carried route naming an expert the model does not have: refused, naming file and field.
    from megatron_rl.models.routes import decode, encode

    shutil.rmtree(part / "checkpoints" / "step_000002")
    (part / "checkpoints" / "latest").write_text("step_000001")
    f = part / "checkpoints" / "step_000001" / "trainer_state.json"
    bad = decode(state["partial"]["routes"][0][2], 2, 2, 8, "test")
    bad[0, 0, 0] = 8
    state["partial"]["routes"][0][2] = encode(bad)
    f.write_text(json.dumps(state))
    rehash(f.parent, f.name)  # the tampered field is what is refused, not the checksum
    proc = train(config, part, expect=None)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert f"{f}: field partial.routes[0]: expert id 8 outside 0..7" in proc.stderr, proc.stderr[-2000:]
