"""Held-out validation through `flexfloor train` as a user runs it: the tiny CPU example (float64,
seed 0, its 250-step SFT warm start) evaluates its held-out file at step 0 and every `eval.every`
steps, and 10 GRPO steps raise held-out greedy accuracy over the warm start."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu_grpo.yaml"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_example_heldout_file_is_disjoint_from_training():
    import yaml

    cfg = yaml.safe_load(EXAMPLE.read_text())
    train, heldout = _rows(ROOT / cfg["data"]["path"]), _rows(ROOT / cfg["eval"]["path"])
    assert len(heldout) == 41 and not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_raises_heldout_accuracy_over_the_warm_start(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(EXAMPLE), "--out",
                           str(out), "--steps", "10", "eval.every=10", "checkpoint.export_hf=false",
                           "logging.wandb_mode=disabled"], cwd=ROOT, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stderr[-3000:]
    val = {r["step"]: r for r in _rows(out / "metrics.jsonl") if "val/pass@1" in r}
    assert sorted(val) == [0, 10]
    assert val[0]["val/prompts"] == val[10]["val/prompts"] == 41
    print(f"held-out pass@1: warm start {val[0]['val/pass@1']:.3f} -> step 10 {val[10]['val/pass@1']:.3f}")
    assert val[10]["val/pass@1"] >= val[0]["val/pass@1"] + 4 / 41  # at least 4 more of the 41 right
    assert "held-out pass@1" in proc.stdout
