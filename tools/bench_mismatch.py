"""Routing replay (R3) on the same rollouts: the training-inference mismatch without and with it.

    python tools/bench_mismatch.py [--device cpu|cuda] [--dtype bfloat16] [--steps 20]

One trainer (one rank; `--model`: tiny, wide (default) or small, see MODELS) runs GRPO steps on
the arithmetic task. Every step's rollout is measured twice under the training numerics: the
old-log-prob forward with the training router's own top-k (replay off) and with the rollout's
recorded routes (replay on). Per step and side by side: router agreement (share of token-layer
top-k sets equal to the rollout's), tokens with at least one flipped layer, and the mean and max
|old - rollout log-prob| per response token. With replay on, training routes every token through
the recorded experts by construction (agreement of the routes it *uses* is 1); its own router's
agreement is the same figure as without. The update then runs with `--train-replay` or without.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl.models.config import MoEModelConfig  # noqa: E402
from tests.gpu.checks import gpu_checks  # noqa: E402


def _measure(trainer, responses, advantages, replay: bool) -> dict:
    t = trainer
    t.cfg.grpo.routing_replay = replay  # read per call by PolicyUpdate
    recomputed = t.update.recompute_logprobs(t.update.minibatches(responses, advantages))
    mism = recomputed.mismatch.finish(t.world)
    gap = mx = n = 0.0
    for batch in recomputed.batches:
        for mb in batch.micro:
            d = (mb.old_logp.double() - mb.rollout_logp).abs() * mb.packed.loss_mask.double()
            gap, mx, n = gap + float(d.sum()), max(mx, float(d.max())), n + float(mb.packed.loss_mask.sum())
    return {"agreement": mism["router_agreement"], "any_flip": mism["tokens_any_flip"],
            "gap": gap / max(n, 1.0), "gap_max": mx, "recomputed": recomputed}


def _bench_rank(ctx, cfg, steps: int, train_replay: bool, out_dir: str) -> dict:
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.rl.update.grpo import group_advantages
    from megatron_rl.trainer import build_trainer

    t = build_trainer(cfg, load_prompts(cfg.data), ctx, out_dir, None)
    rows = []
    for step in range(1, steps + 1):
        batch = t.iterator.next_batch()
        torch.manual_seed(step)
        rollout = t.rollout.run(step, [t.data[i] for i in batch.indices], t.history)
        advantages = group_advantages(gpu_checks._shaped_rewards(rollout.responses), cfg.grpo.group_size)
        off = _measure(t, rollout.responses, advantages, False)
        on = _measure(t, rollout.responses, advantages, True)
        t.cfg.grpo.routing_replay = train_replay
        t.update.update(on["recomputed"] if train_replay else off["recomputed"])
        t.optimizer.zero_grad(set_to_none=True)
        rows.append({"step": step, "off": {k: v for k, v in off.items() if k != "recomputed"},
                     "on": {k: v for k, v in on.items() if k != "recomputed"}})
    return {"rows": rows}


# tiny: examples/tiny_cpu_grpo.yaml's model (8 experts, top-2: its routes rarely flip); wide: as
# small as a CPU run of 20 steps allows with bf16 near-ties (32 experts, top-4); small: the GPU
# checks' model (64 experts, top-8).
MODELS = {"tiny": None, "small": gpu_checks.SMALL_QWEN3_MOE,
          "wide": MoEModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                 kv_channels=16, num_moe_experts=32, moe_router_topk=4, moe_ffn_hidden_size=32,
                                 vocab_size=20, init_method_std=0.05)}


def bench(*, device: str = "cpu", dtype: str = "bfloat16", steps: int = 20, model: str = "wide",
          train_replay: bool = True, lr: float = 1e-3, **shape) -> list[dict]:
    """`shape`: grpo_config's prompts_per_step, group_size, max_response_len."""
    from megatron_rl.parallel.launch import run_ranks

    cfg = gpu_checks.grpo_config(device=device, dtype=dtype, lr=lr, **shape)
    if MODELS[model] is None:
        from megatron_rl.config import load_dataclass
        from megatron_rl.trainer_config import TrainerConfig

        cfg = replace(cfg, model=load_dataclass(TrainerConfig, REPO / "examples" / "tiny_cpu_grpo.yaml", {}).model)
    else:
        cfg = replace(cfg, model=MODELS[model])
    with tempfile.TemporaryDirectory() as out:
        return run_ranks(_bench_rank, 1, cfg, steps, train_replay, out, timeout_s=1800, device=device)["rows"]


def table(rows: list[dict]) -> str:
    out = ["| step | router agreement | tokens any flip | logp gap, replay off | logp gap, replay on "
           "| gap max off | gap max on |", "|" + " --- |" * 7]
    for r in rows:
        a, b = r["off"], r["on"]
        out.append(f"| {r['step']} | {a['agreement']:.4f} | {a['any_flip']:.3f} | {a['gap']:.2e} | {b['gap']:.2e} "
                   f"| {a['gap_max']:.2e} | {b['gap_max']:.2e} |")
    mean = lambda side, k: sum(r[side][k] for r in rows) / len(rows)  # noqa: E731
    out.append(f"| mean | {mean('off', 'agreement'):.4f} | {mean('off', 'any_flip'):.3f} | {mean('off', 'gap'):.2e} "
               f"| {mean('on', 'gap'):.2e} | | |")
    out.append(f"\nlogp gap with replay / without: {mean('on', 'gap') / max(mean('off', 'gap'), 1e-300):.3f}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", choices=sorted(MODELS), default="wide")
    ap.add_argument("--no-train-replay", action="store_true", help="update without replay")
    args = ap.parse_args(argv)
    print(table(bench(device=args.device, dtype=args.dtype, steps=args.steps, model=args.model,
                      train_replay=not args.no_train_replay)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
