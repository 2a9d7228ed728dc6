"""Optimizer-step seconds with the state on the device (torch AdamW over fp32 masters) against
`optim.offload: cpu` (DeepSpeed's CPU Adam on host masters, gradients to the host, weights back),
side by side on one slice of parameters, and the device bytes offload frees for Qwen3-30B-A3B:

    python tools/bench_offload.py [--device cpu|cuda] [--params 20e6] [--reps 5]

The slice is bf16 weights with fp32 gradients, stepped by `rl/optim/zero.py`'s `ShardedOptimizer` on one
rank (replicated vs offloaded). On a GPU it also measures the device bytes each optimizer's state
holds (`torch.cuda.memory_allocated` around building and first stepping it). The 30B-A3B figures
are computed (elastic/planning/memory/train_memory.py) for 16 ranks under ZeRO-1.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _slice(params: int, device: str) -> nn.Module:
    """A stand-in model of `params` bf16 parameters in 64 dense matrices (no experts)."""
    side = max(int((params / 64) ** 0.5), 8)
    return nn.Sequential(*(nn.Linear(side, side, bias=False) for _ in range(64))).to(device, torch.bfloat16)


def _optimizer(model, offload: bool):
    from megatron_rl.rl.optim.cpu_adam import deepspeed_cpu_adam
    from megatron_rl.rl.optim.zero import ShardedOptimizer

    def inner(ps):
        return deepspeed_cpu_adam(ps, 1e-4, (0.9, 0.999), 1e-8, 0.0) if offload else torch.optim.AdamW(ps, lr=1e-4)

    return ShardedOptimizer(model, inner, 0, 1, 1.0, offload=offload, is_expert=lambda n: False)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(params: int, device: str, reps: int) -> dict:
    out = {}
    for offload in (False, True):
        model = _slice(params, device)
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        opt = _optimizer(model, offload)
        times = []
        for i in range(reps + 1):
            for p in model.parameters():
                p.grad = torch.full_like(p, 1e-3)
                opt._accumulate(p)
            _sync(device)
            t = time.perf_counter()
            opt.finish_step()
            _sync(device)
            if i:  # the first step allocates the moments (and builds the CPU Adam on first use)
                times.append(time.perf_counter() - t)
            opt.zero_grad()
        held = (torch.cuda.memory_allocated() if device == "cuda" else 0) - before
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        out["offload" if offload else "device"] = {"step_s": statistics.median(times),
                                                   "device_state_bytes": held - weights,
                                                   "computed_state_bytes": opt.device_state_bytes()}
        opt.close()
        del model, opt
    out["params"] = sum(p.numel() for p in _slice(params, "cpu").parameters())
    return out


def freed_30b(ranks: int = 16) -> dict:
    from elastic.planning.memory.train_memory import OptimizerSetup, training_memory
    from megatron_rl.config import load_dataclass
    from megatron_rl.rollout.memory import weight_bytes
    from megatron_rl.trainer_config import TrainerConfig

    cfg = load_dataclass(TrainerConfig, REPO / "examples" / "qwen3_30b_a3b_16xh100.yaml", {})
    dense, expert = weight_bytes(cfg.model, 1)
    kw = dict(dense_params=dense, expert_params_per_expert=expert, experts_held=cfg.model.num_moe_experts // ranks,
              world=ranks, activations=0)
    return {s: training_memory(setup=OptimizerSetup("torch", s, True, 2), **kw).optimizer
            for s in ("replicated", "sharded", "offloaded")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--params", type=float, default=20e6)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    r = measure(int(args.params), args.device, args.reps)
    d, o = r["device"], r["offload"]
    print(f"optimizer step, {r['params'] / 1e6:.1f} M bf16 params on {args.device} (median of {args.reps}): "
          f"state on the device {d['step_s']:.3f} s, offloaded (DeepSpeed CPU Adam) {o['step_s']:.3f} s, "
          f"ratio {o['step_s'] / d['step_s']:.2f}x")
    if args.device == "cuda":
        print(f"device bytes of the optimizer state, measured: on the device {d['device_state_bytes'] / 1e6:.1f} MB, "
              f"offloaded {o['device_state_bytes'] / 1e6:.1f} MB (computed {d['computed_state_bytes'] / 1e6:.1f} "
              f"and {o['computed_state_bytes'] / 1e6:.1f} MB)")
    f = freed_30b()
    gb = {k: v / 1e9 for k, v in f.items()}
    print(f"Qwen3-30B-A3B on 16 ranks, per rank (computed): optimizer state on the GPU replicated "
          f"{gb['replicated']:.1f} GB, ZeRO-1 {gb['sharded']:.1f} GB, offloaded {gb['offloaded']:.1f} GB: offload "
          f"frees {gb['sharded']:.1f} GB over ZeRO-1 ({gb['replicated']:.1f} GB over replicated) for the KV cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
