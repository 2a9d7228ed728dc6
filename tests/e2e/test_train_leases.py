"""Leases inside `flexfloor train`: rewards scored on detached ranks change nothing training sees;
a lease that ignores pre-emption ends the run with a clear LeaseTimeout and the step's data kept."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.train import learning, metrics, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu_grpo.yaml"
# What training sees (metrics.jsonl apart from timings, the ledger and the `lease/` figures).
LEARNING = ("reward/", "response_length/", "actor/", "training/", "elastic/stages", "elastic/placement")
NATURAL = ("--policy", "natural", "--floor", "1")
NO_WANDB = {"WANDB_MODE": "disabled"}


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """The example's own warm start (its 250 SFT steps on its 4 ranks), once, as the `init` of every
    run here; the runs train from it on `_data`'s 16 prompts."""
    out = tmp_path_factory.mktemp("warm") / "sft"
    proc = subprocess.run([sys.executable, "tools/sft_warmstart.py", "--config", str(EXAMPLE), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=500, env={**os.environ, **NO_WANDB})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _data(tmp_path) -> Path:
    """The example's first 15 prompts with a one-digit answer and its first with a two-digit one: a
    step's batch is the whole set (`prompts_per_step: 16`), so step 2 plans from every prompt's own
    history (step 1). Three ranks then hold only one-digit prompts (2 tokens with EOS), one rank the
    two-digit prompt (3 tokens): the plan detaches a one-digit rank first, and at temperature 0.25
    (`_config`) it drains a tick before the other (at 1.0 about one one-digit answer in eight has
    two digits, so a rank's 32 often do not all end early). On the example's own batches every rank
    has two-digit answers, so whether a rank drains early hangs on the warm start's last bits,
    which differ between CPUs (ATen's vector kernels round sums differently)."""
    rows = [json.loads(line) for line in (ROOT / "examples" / "data" / "arith_train.jsonl").open()]
    short = [r for r in rows if len(r["answer"]) == 1][:15]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in short + [next(r for r in rows if len(r["answer"]) == 2)]))
    return path


def _config(tmp_path, warm, **leases):
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg.update(init=str(warm), steps=2, prompts_per_step=16)
    cfg["data"]["path"] = str(_data(tmp_path))
    cfg["generation"]["temperature"] = 0.25
    # A free shrink, so that a rank whose 2-token answers drain a tick early detaches (at this
    # engine's measured 10 ms no shrink pays back in a 3-token rollout, and every rank stays).
    cfg["elastic"]["shrink_cost_s"] = 1e-6
    cfg.pop("eval", None)  # held-out validation logs rows of its own (step 0): not what is compared here
    cfg["warmstart"]["sft_steps"] = 0
    cfg["checkpoint"] = {"every": 1, "export_hf": True}
    cfg["leases"].update(leases)
    path = tmp_path / f"cfg{len(list(tmp_path.glob('cfg*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_rewards_scored_in_leases_train_exactly_like_no_leases(warm, tmp_path):
    from safetensors.torch import load_file

    train(_config(tmp_path, warm), tmp_path / "on", *NATURAL, env=NO_WANDB)
    train(_config(tmp_path, warm, jobs=[]), tmp_path / "off", *NATURAL, env=NO_WANDB)
    on, off = metrics(tmp_path / "on"), metrics(tmp_path / "off")
    assert [learning(m, LEARNING) for m in on] == [learning(m, LEARNING) for m in off]
    assert all("reward/mean" in m and "actor/loss" in m for m in on)  # the comparison compares something
    wa, wb = (load_file(str(tmp_path / d / "hf" / "model.safetensors")) for d in ("on", "off"))
    assert wa.keys() == wb.keys() and all(torch_equal(wa[k], wb[k]) for k in wa)
    print("lease per step:", [{k: v for k, v in m.items() if k.startswith("lease/")} for m in on])
    assert sum(m["lease/leased_rank_s"] for m in on) > 0
    assert sum(m["lease/rewards_scored"] for m in on) > 0, "no reward was scored in a lease"
    assert all(m["lease/rewards_scored"] == 0 and m["lease/leased_rank_s"] == 0 for m in off)
    assert len(off[1]["elastic/stages"]) > 1, "step 2's plan keeps every rank: the test proves nothing"
    assert off[1]["elastic/rank_seconds/idle"] > 0, "no rank detached at step 2: the test proves nothing"


def torch_equal(a, b):
    return bool((a == b).all())


def test_a_lease_that_ignores_preemption_ends_in_lease_timeout_with_the_step_kept(warm, tmp_path):
    out = tmp_path / "stuck"
    cfg = _config(tmp_path, warm, fault="stuck-lease", grace_s=0.5)
    proc = train(cfg, out, *NATURAL, expect=None, env=NO_WANDB)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "lease 'fault-stuck' did not yield within 0.5s of pre-emption" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    done = metrics(out)
    assert done and all(m["lease/leased_rank_s"] == 0 for m in done)  # the steps before it
    assert (out / "checkpoints" / f"step_{done[-1]['step']:06d}").is_dir()
    streamed = [json.loads(line) for f in (out / "rollout").glob("responses.rank*.jsonl") for line in f.open()]
    assert streamed and len({(r["prompt_id"], r["sample"]) for r in streamed}) == len(streamed)
    assert all(len(r["tokens"]) == len(r["logprobs"]) for r in streamed)
    assert list((out / "rollout").glob("ledger.rank*.json")), "the failing rank's ledger so far"
