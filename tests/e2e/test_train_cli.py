"""`flexfloor train` as a user runs it: resume, planned == vanilla, metrics files, bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import wandb_history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]

# Single-digit answers and one-token responses keep a random policy's reward above zero, so every
# step has advantages and real updates.
CONFIG = {
    "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
              "kv_channels": 8, "num_moe_experts": 8, "moe_router_topk": 2,
              "moe_ffn_hidden_size": 16, "vocab_size": 20},
    "grpo": {"group_size": 8, "micro_batch": 8, "tis_cap": 2.0, "kl_coef": 0.05},
    "optim": {"lr": 0.003},
    "generation": {"max_response_len": 3},
    "checkpoint": {"every": 1, "export_hf": True},
    "steps": 3, "prompts_per_step": 4, "seed": 5, "dtype": "float64",
}
# What training sees; timings and the ledger are measurements and differ run to run.
LEARNING = ("reward_mean", "reward_std", "reward_outcomes", "response_len_mean", "loss",
            "grad_norm", "kl", "clip_frac", "tis_weight_mean", "epoch")


def _setup(tmp_path, **changes):
    from megatron_rl.data.arith import make_problems, write_jsonl

    data = tmp_path / "arith.jsonl"
    if not data.exists():
        write_jsonl(make_problems(20, seed=0, max_operand=4, ops="+"), data)
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"] = {"path": str(data)}
    for key, value in changes.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / f"cfg{len(list(tmp_path.glob('cfg*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config, out, *extra, expect=0):
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(config),
                           "--out", str(out), *extra], cwd=ROOT, capture_output=True, text=True, check=False,
                          timeout=500, env={**__import__("os").environ, "WANDB_MODE": "offline"})
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def _metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(Path(out) / "hf" / "model.safetensors"))


def _same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 3-step run on 2 ranks."""
    tmp = tmp_path_factory.mktemp("straight")
    out = tmp / "out"
    _train(_setup(tmp), out, "--ranks", "2")
    return tmp, out


def test_resume_matches_uninterrupted_run(straight, tmp_path):
    _, full = straight
    cfg = _setup(tmp_path)
    part = tmp_path / "out"
    _train(cfg, part, "--ranks", "2", "--steps", "2")
    proc = _train(cfg, part, "--ranks", "2")
    assert "resuming from" in proc.stderr and "step_000002" in proc.stderr
    a, b = _metrics(full), _metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3]
    for m_full, m_resumed in zip(a, b):
        assert {k: m_full[k] for k in LEARNING} == {k: m_resumed[k] for k in LEARNING}
    assert _same_weights(full, part)
    state = json.loads((part / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data"]["position"] == 12
    history = (part / "checkpoints" / "step_000003" / "length_history.jsonl").read_text().splitlines()
    assert len(history) == 3 * 4 * 8


def test_metrics_jsonl_and_offline_wandb(straight):
    _, out = straight
    rows = _metrics(out)
    want = {"step", "reward_mean", "reward_std", "response_len_mean", "response_len_p50",
            "response_len_p99", "response_len_max", "truncated_share", "rank_seconds", "rank_steps",
            "dummy_share", "phase_s", "tokens_per_s", "loss", "grad_norm", "kl"}
    assert len(rows) == 3 and want <= set(rows[0])
    assert set(rows[0]["rank_seconds"]) == {"busy", "dummy", "transition", "leased", "idle"}
    assert set(rows[0]["phase_s"]) == {"rollout", "reward", "logprob", "update", "sync"}
    run_file = next((out / "wandb").glob("offline-run-*/run-*.wandb"))
    history = wandb_history(run_file)
    assert [h["_step"] for h in history] == [1, 2, 3]
    for h, row in zip(history, rows):
        assert h["reward_mean"] == pytest.approx(row["reward_mean"])
        assert h["rank_seconds/dummy"] == pytest.approx(row["rank_seconds"]["dummy"])
        assert {"loss", "grad_norm", "kl", "response_len_p99", "phase_s/rollout", "tokens_per_s"} <= set(h)


@pytest.mark.parametrize("policy", ["planned", "adaptive"])
def test_planned_rollout_trains_exactly_like_vanilla(tmp_path, policy):
    # 8 prompts, 4 per step: from step 3 on, the planner has the first epoch's lengths to go by.
    # A random policy's lengths carry no per-prompt signal, so the planner may keep every rank
    # (shrinks and token equality under them are the runtime's tests); the placement does differ.
    # `adaptive` re-plans at every status check (without migration in training).
    cfg = _setup(tmp_path, **{"generation.max_response_len": 8, "checkpoint.every": 0, "steps": 4,
                              "elastic.shrink_cost_s": 1e-6, "data.path": str(_small_data(tmp_path))})
    _train(cfg, tmp_path / "vanilla", "--ranks", "4", "--policy", "vanilla")
    _train(cfg, tmp_path / policy, "--ranks", "4", "--policy", policy, "--floor", "2")
    v, p = _metrics(tmp_path / "vanilla"), _metrics(tmp_path / policy)
    assert [{k: m[k] for k in LEARNING} for m in v] == [{k: m[k] for k in LEARNING} for m in p]
    assert _same_weights(tmp_path / "vanilla", tmp_path / policy)
    assert all(len(m["stages"]) == 1 for m in v)
    print(policy, "stages, layout per step:", [(m["stages"], m["layout"]) for m in p])
    assert any(mv["placement"] != mp["placement"] for mv, mp in zip(v, p)), \
        "planned placed every response where vanilla did: the test proves nothing"


def _small_data(tmp_path):
    from megatron_rl.data.arith import make_problems, write_jsonl

    path = tmp_path / "small.jsonl"
    write_jsonl(make_problems(8, seed=1, max_operand=4, ops="+"), path)
    return path


def test_bad_inputs_fail_clearly(straight, tmp_path):
    _, out = straight
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n')
    proc = _train(_setup(tmp_path, **{"data.path": str(bad)}), tmp_path / "o1", expect=2)
    assert f"{bad}:2: missing prompt field 'prompt'" in proc.stderr and "Traceback" not in proc.stderr
    other = _setup(tmp_path, **{"model.hidden_size": 64, "steps": 5})
    proc = _train(other, out, "--ranks", "2", expect=2)
    assert "checkpoint is for another model shape" in proc.stderr and "hidden_size" in proc.stderr
    assert "Traceback" not in proc.stderr
