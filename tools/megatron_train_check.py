"""tools/gpu_check.sh's row `m: train backend=megatron, checkpoint + resume`: `flexfloor train` with
`backend=megatron device=cuda` for one GRPO step with a checkpoint, then a resume to step 2, as a
user runs it; the row holds both steps' loss and grad norm. Needs CUDA and megatron-core (its CPU
twin is tests/e2e/test_megatron_cli_harness.py on the test harness).

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


def _flat(d: dict, prefix: str = "") -> dict:
    """CONFIG as dotted overrides (load_dataclass's form)."""
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def main() -> int:
    from megatron_rl.data.arith import make_problems, write_jsonl
    from tools.gpu_summary import record

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args()
    name, t0 = "m: train backend=megatron, checkpoint + resume", time.perf_counter()
    from tools.gpu_env import DRYRUN

    if DRYRUN:  # tools/gpu_check.sh's CPU dry run: the config and the training modules, not the CUDA run
        import megatron_rl.rl.megatron_train  # noqa: F401
        from megatron_rl.config import load_dataclass
        from megatron_rl.trainer_config import TrainerConfig

        load_dataclass(TrainerConfig, None, {**_flat(CONFIG), "device": "cpu", "dtype": a.dtype,
                                             "data.path": str(ROOT / "examples" / "data" / "arith_train.jsonl")})
        record(name, "pass", "dry run (cpu): the config loads and the megatron training modules import; "
               "megatron-core's forward needs CUDA", time.perf_counter() - t0)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_jsonl(make_problems(64, seed=0, max_operand=9, ops="+"), tmp / "arith.jsonl")
        cfg = {**CONFIG, "dtype": a.dtype, "data": {"path": str(tmp / "arith.jsonl")}}
        (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
        runs = []
        for steps in (1, 2):
            r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(tmp / "cfg.yaml"),
                                "--out", str(tmp / "out"), "--ranks", str(a.ranks), "--steps", str(steps)],
                               cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
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
        record(name, "pass" if ok else "fail", detail, time.perf_counter() - t0)
        print(detail)
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
