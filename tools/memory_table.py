"""One training rank's memory for a trainer config, by part, for both backends and every optimizer
state placement (replicated, ZeRO-1 sharded, offloaded): the table of docs/planner.md.

    python tools/memory_table.py [--config examples/qwen3_30b_a3b_16xh100.yaml] [--device-gb 80]

Arithmetic on the configuration (elastic/planning/memory/train_memory.py), not a measurement: the
weights from the model's exact parameter counts, the update's micro-batch at
`grpo.micro_batch x generation.max_response_len` tokens, and the KV budget of a rank holding its
training share of the experts, with how many sequences of the longest response it holds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic.planning.memory.train_memory import OptimizerSetup, activation_bytes, training_memory  # noqa: E402
from elastic.planning.shape import MemoryBudget  # noqa: E402

GB = 1e9


def rows(cfg, device_bytes: int) -> list[dict]:
    from megatron_rl.rollout.memory import kv_bytes_per_token, weight_bytes

    m, world = cfg.model, cfg.ranks
    dtype_bytes = {"bfloat16": 2, "float32": 4, "float64": 8}[cfg.dtype]
    dense, expert = weight_bytes(m, 1)  # one byte per parameter: the parameter counts
    held = m.num_moe_experts // world
    seq = cfg.generation.max_response_len
    acts = activation_bytes(cfg.grpo.micro_batch * seq, m.num_layers, m.hidden_size, m.moe_router_topk,
                            m.moe_ffn_hidden_size, m.vocab_size, dtype_bytes, cfg.recompute_activations,
                            cfg.logprob_chunk_tokens)
    kv_token = kv_bytes_per_token(m, dtype_bytes)
    out = []
    for backend, state in [("torch", "replicated"), ("torch", "sharded"), ("torch", "offloaded"),
                           ("megatron", "sharded")]:
        setup = OptimizerSetup(backend, state, dtype_bytes < 4 or state == "offloaded", dtype_bytes)
        mem = training_memory(dense_params=dense, expert_params_per_expert=expert, experts_held=held,
                              world=world, setup=setup, activations=acts, reference=cfg.grpo.kl_coef > 0)
        budget = MemoryBudget(device_bytes=device_bytes, dense_bytes=mem.dense_weights,
                              expert_bytes=expert * dtype_bytes, kv_bytes_per_token=kv_token,
                              resident_bytes=mem.resident, source="given")
        kv = budget.kv_budget_bytes(held)
        out.append({"backend": backend, "state": state, **mem.to_dict(), "kv_budget": kv,
                    "sequences": max(kv, 0) // (kv_token * seq), "usable": budget.usable_bytes})
    return out


def markdown(table: list[dict], seq: int) -> str:
    head = ("| backend | optimizer state | weights | optimizer | grads (kept) | grads (update) | activations "
            f"| update peak | KV budget | {seq}-token sequences |")
    lines = [head, "|" + " --- |" * 10]
    for r in table:
        lines.append(f"| {r['backend']} | {r['state']} | {(r['dense_weights'] + r['expert_weights']) / GB:.1f} "
                     f"| {r['optimizer'] / GB:.1f} | {r['resident_grads'] / GB:.1f} | {r['update_grads'] / GB:.1f} "
                     f"| {r['activations'] / GB:.1f} | {r['update_peak'] / GB:.1f} | {r['kv_budget'] / GB:.1f} "
                     f"| {r['sequences']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron_rl.config import load_dataclass
    from megatron_rl.trainer_config import TrainerConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "qwen3_30b_a3b_16xh100.yaml"))
    ap.add_argument("--device-gb", type=float, default=80.0, help="one rank's device memory (GB)")
    args = ap.parse_args(argv)
    cfg = load_dataclass(TrainerConfig, args.config, {})
    table = rows(cfg, int(args.device_gb * GB))
    print(f"{cfg.ranks} ranks, {args.device_gb:g} GB each ({table[0]['usable'] / GB:.1f} GB usable), {cfg.dtype}; GB:")
    print(markdown(table, cfg.generation.max_response_len))
    return 0


if __name__ == "__main__":
    sys.exit(main())
