"""tools/gpu_check.sh's row `m: train backend=megatron, checkpoint + resume`: `flexfloor train` with
`backend=megatron device=cuda` for one GRPO step with a checkpoint, then a resume to step 2, as a
user runs it; the row holds both steps' loss and grad norm. Needs CUDA and megatron-core; in
tools/gpu_check.sh's dry run (FF_GPU_DRYRUN=1) the same two runs go on CPU at tiny shapes, megatron-core's
layers through the test harness (tests/megatron_harness.py; its CPU twin in CI is
tests/e2e/test_megatron_cli_harness.py).

    python tools/megatron_train_check.py [--ranks 1] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = {
    "model": {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
              "kv_channels": 32, "num_moe_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 128,
              "vocab_size": 20},
    "grpo": {"group_size": 8, "micro_batch": 16, "kl_coef": 0.0},
    "optim": {"lr": 1e-4},
    "generation": {"max_response_len": 4},
    "checkpoint": {"every": 1, "export_hf": True},
    "logging": {"wandb_mode": "disabled"},
    "prompts_per_step": 8, "seed": 3, "backend": "megatron", "device": "cuda",
}


# The dry run's shapes: the same config, a model and batch for seconds on CPU.
DRYRUN_CONFIG = {"model": {**CONFIG["model"], "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                           "kv_channels": 16, "num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 32},
                 "grpo": {**CONFIG["grpo"], "group_size": 2, "micro_batch": 4}, "prompts_per_step": 2,
                 "device": "cpu"}


def main() -> int:
    from megatron_rl.data.arith import make_problems, write_jsonl
    from tools.gpu_env import DRYRUN, dryrun_detail
    from tools.gpu_summary import record

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args()
    name, t0 = "m: train backend=megatron, checkpoint + resume", time.perf_counter()
    env = None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_jsonl(make_problems(64, seed=0, max_operand=9, ops="+"), tmp / "arith.jsonl")
        cfg = {**CONFIG, "dtype": a.dtype, "data": {"path": str(tmp / "arith.jsonl")}}
        if DRYRUN:  # on CPU at tiny shapes, each run's processes under the megatron-core test harness
            from tests.megatron_harness import site_env  # tests only: the product never imports it

            cfg.update(DRYRUN_CONFIG)
            env = site_env()
        (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
        runs = []
        for steps in (1, 2):
            r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(tmp / "cfg.yaml"),
                                "--out", str(tmp / "out"), "--ranks", str(a.ranks), "--steps", str(steps)],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
            runs.append(r)
            if r.returncode != 0:
                tail = r.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
                record(name, "fail", f"run to step {steps}: exit {r.returncode}: {tail[0][:200]}",
                       time.perf_counter() - t0)
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
        rows = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
        ckpt = tmp / "out" / "checkpoints" / "step_000001"
        shards = sorted(f.name for f in ckpt.glob("megatron_optim.rank*.pt"))
        sums = json.loads((ckpt / "checksums.json").read_text())
        ok = ("resuming from" in runs[1].stderr and [r["step"] for r in rows] == [1, 2]
              and len(shards) == a.ranks and set(shards) <= set(sums) and (tmp / "out" / "hf").exists())
        detail = (f"{a.dtype}, {a.ranks} rank(s): " + "; ".join(
            f"step {r['step']} loss {r['actor/loss']:+.4f} grad norm {r['actor/grad_norm']:.3g}" for r in rows)
            + f"; resumed: {'resuming from' in runs[1].stderr}; optimizer shards {shards} in checksums")
        record(name, "pass" if ok else "fail", dryrun_detail(detail), time.perf_counter() - t0,
               evidence={"training runs": len(runs), "steps logged": len(rows)})
        print(detail)
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
