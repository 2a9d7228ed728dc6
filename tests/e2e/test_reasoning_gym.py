"""A real task from a package, used as a user would: tools/prepare_reasoning_gym.py writes
reasoning-gym's basic_arithmetic as verl-format parquet plus a verl-signature reward file, and
`flexfloor train` runs examples/tiny_cpu_reasoning_gym.yaml on them (only the file paths and the
run's length changed): its warm start and 10 GRPO steps raise the held-out
`val-core/basic_arithmetic/reward/mean@1` (float64, seed 0, deterministic: measured 0.57 -> 0.65
of 100 prompts; asserted: at least 4 more right), and the generations land in
OUT/val_generations.jsonl. The example's 40-step curve is in docs/training.md (Validation).
Slow: the example's 250-step warm start alone takes minutes on a loaded 2-core machine."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu_reasoning_gym.yaml"
PARAMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
          "allow_parentheses": False, "allow_negation": False}
CORE = "val-core/basic_arithmetic/reward/mean@1"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_reasoning_gym_example_raises_heldout_reward(tmp_path):
    data = tmp_path / "rg"
    prep = subprocess.run([sys.executable, "tools/prepare_reasoning_gym.py", "--task", "basic_arithmetic",
                           "--out", str(data), "--train", "400", "--heldout", "100", "--params", json.dumps(PARAMS)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr[-2000:]
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(EXAMPLE), "--out", str(out),
         "--steps", "10", f"data.path={data / 'train.parquet'}",
         f"eval.path={data / 'heldout.parquet'}", f"reward.path={data / 'reward.py'}", "eval.every=10",
         "logging.wandb_mode=disabled"],
        cwd=ROOT, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r for r in rows if CORE in r}
    first, last = val[0][CORE], val[max(val)][CORE]
    print(f"held-out {CORE}: warm start {first:.3f} -> step {max(val)} {last:.3f}")
    assert last >= first + 0.04  # 4 of the 100 held-out prompts
    assert {"best@1/mean", "maj@1/mean"} <= {k.rsplit("reward/", 1)[1] for k in val[0] if k.startswith("val-core/")}
    assert all(r["reward/outcomes/error"] == 0 and r["reward/outcomes/scored"] > 0 for r in rows if "reward/mean" in r)
    generations = [json.loads(line) for line in (out / "val_generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in generations] == [0] * 8 + [max(val)] * 8
    assert generations[0]["data_source"] == "basic_arithmetic" and generations[0]["prompt"].startswith("Calculate ")
