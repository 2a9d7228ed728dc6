"""A user's first verl run: the example config with only `data.path` pointed at a verl-format
parquet of the example's own prompts trains (it was refused: the example pinned
`answer_field: answer`, so the answer at `reward_model.ground_truth` was never looked for). The run
is cut to one step after a one-step warm start, as a test must; nothing else of the config changes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu_grpo.yaml"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_trains_on_a_verl_parquet_of_its_own_prompts(tmp_path):
    datasets = pytest.importorskip("datasets")
    plain = [json.loads(line) for line in (ROOT / "examples" / "data" / "arith_train.jsonl").read_text().splitlines()]
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": r["answer"]}, "extra_info": {"index": i}}
            for i, r in enumerate(plain[:64])]
    data = tmp_path / "arith.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(EXAMPLE), "--out", str(out),
         f"data.path={data}", "--steps", "1", "warmstart.sft_steps=1", "eval.every=0", "logging.wandb_mode=disabled"],
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and step["reward/outcomes/no_reference"] == 0
    judged = sum(step[f"reward/outcomes/{k}"] for k in ("correct", "wrong", "unparsable"))
    assert judged == 16 * 8  # prompts_per_step x group_size, each against its ground truth
