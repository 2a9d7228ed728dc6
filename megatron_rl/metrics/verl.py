"""The step figures verl logs that FlexFloor's own metrics do not already hold.

verl users compare curves across frameworks by verl's names (`verl/trainer/ppo/metric_utils.py`):
`critic/advantages/*`, `prompt_length/*`, `timing_per_token_ms/*`, `perf/throughput`,
`perf/mfu/actor`, `training/global_step`. The trainer adds these raw figures to each step's
metrics; `metrics/keys.py` names them, and gives the figures both frameworks have (`reward/mean`
is verl's `critic/score/mean`, ...) their verl name beside ours. docs/training.md maps every key.

Model FLOPs: per token, 6 x the parameters a token passes through (attention, its top-k experts'
SwiGLU, the router, the output projection: forward + backward), plus the attention scores'
12 x layers x heads x head_dim x sequence length, the estimate verl's FlopsCounter makes. The
device's peak comes from `PEAK_FLOPS` (dense bf16 tensor-core figures of the vendors' data
sheets); on CPU, or a device the table lacks, it is 0 and so is the MFU.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Dense (no sparsity) bf16 peak per device, FLOP/s, by a substring of torch's device name.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12,
              "A800": 312e12, "B200": 2250e12, "L40S": 362e12}


def device_peak_flops(device) -> float:
    """This process's accelerator peak (FLOP/s); 0 on CPU or for a device `PEAK_FLOPS` lacks."""
    import torch

    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return 0.0
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in PEAK_FLOPS.items() if k in name), 0.0)


def active_params(m) -> int:
    """Parameters one token passes through in a `MoEModelConfig` model (embedding lookup excluded)."""
    q = m.num_attention_heads * m.kv_channels
    kv = m.num_query_groups * m.kv_channels
    attention = m.hidden_size * (q + 2 * kv) + q * m.hidden_size
    experts = m.moe_router_topk * 3 * m.hidden_size * m.moe_ffn_hidden_size + m.hidden_size * m.num_moe_experts
    return m.num_layers * (attention + experts) + m.vocab_size * m.hidden_size


def training_flops(m, seq_lens: Sequence[int]) -> float:
    """FLOPs of one forward + backward over sequences of these lengths."""
    tokens = float(sum(seq_lens))
    attention = 12.0 * m.num_layers * m.num_attention_heads * m.kv_channels * float(sum(n * n for n in seq_lens))
    return 6.0 * active_params(m) * tokens + attention


def verl_figures(step: int, advantages, prompt_lens: Sequence[int], response_lens: Sequence[int],
                 times: dict[str, float], step_s: float, world: int, model_cfg, peak_flops: float) -> dict:
    """Raw figures (named by metrics/keys.py) of one step of `world` ranks."""
    adv = np.asarray(advantages, dtype=np.float64)
    prompts = np.asarray(prompt_lens, dtype=np.float64)
    tokens = float(prompts.sum() + sum(response_lens))
    update_s = times.get("update", 0.0)
    flops = training_flops(model_cfg, [p + r for p, r in zip(prompt_lens, response_lens)])
    return {
        "global_step": step,
        "advantages": {"mean": float(adv.mean()), "max": float(adv.max()), "min": float(adv.min())},
        "prompt_len": {"mean": float(prompts.mean()), "max": float(prompts.max())},
        "per_token_ms": {"gen": 1000.0 * times.get("rollout", 0.0) / max(sum(response_lens), 1),
                         "update_actor": 1000.0 * update_s / max(tokens, 1.0)},
        # verl: every token of the step (prompt + response) per second of the step, per device.
        "throughput": tokens / max(step_s, 1e-9) / world,
        "mfu_actor": flops / (update_s * world * peak_flops) if peak_flops > 0 and update_s > 0 else 0.0,
    }
