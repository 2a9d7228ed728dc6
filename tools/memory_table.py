"""One training rank's memory for a trainer config, by part, for both backends and every optimizer
state placement (replicated, ZeRO-1 sharded, offloaded): the table of docs/planner.md.

    python tools/memory_table.py [--config examples/qwen3_30b_a3b_16xh100.yaml] [--device-gb 80]

Arithmetic on the configuration (elastic/planning/memory/train_memory.py), not a measurement: the
weights from the model's exact parameter counts, the backend's copies of its experts, the update's
micro-batch at `grpo.micro_batch x generation.max_response_len` tokens, and the KV budget of a rank
holding its training share of the experts, with how many sequences of the longest response it holds.
The activations are the torch backend's model's (tools/gpu_slice_trace.py traces them); the megatron
rows take the same figure for megatron-core's layers, which nothing traces.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic.planning.memory.train_memory import OptimizerSetup, activation_bytes, training_memory  # noqa: E402
from megatron_rl.backend_rules import backend_rules  # noqa: E402
from megatron_rl.config import load_dataclass  # noqa: E402
from megatron_rl.rollout.memory import memory_budget, weight_bytes  # noqa: E402
from megatron_rl.trainer_config import TrainerConfig  # noqa: E402

GB = 1e9


def rows(cfg: TrainerConfig, device_bytes: int) -> list[dict]:
    m, world = cfg.model, cfg.ranks
    dtype_bytes = {"bfloat16": 2, "float32": 4, "float64": 8}[cfg.dtype]
    dense, expert = weight_bytes(m, 1)  # one byte per parameter: the parameter counts
    held = m.num_moe_experts // world
    seq = cfg.generation.max_response_len
    plain = memory_budget(m, dtype_bytes, torch.device("cpu"), 1, device_bytes=device_bytes)
    acts = activation_bytes(m.shape(dtype_bytes, plain, ranks_per_node=1), cfg.grpo.micro_batch * seq,
                            cfg.recompute_activations, cfg.logprob_chunk_tokens)
    out = []
    for backend, state in [("torch", "replicated"), ("torch", "sharded"), ("torch", "offloaded"),
                           ("megatron", "sharded")]:
        copies = backend_rules(backend).expert_copies
        setup = OptimizerSetup(backend, state, dtype_bytes < 4 or state == "offloaded", dtype_bytes)
        mem = training_memory(dense_params=dense, expert_params_per_expert=expert, experts_held=held,
                              world=world, setup=setup, activations=acts, expert_copies=copies,
                              reference=cfg.grpo.kl_coef > 0)
        budget = replace(plain, resident_bytes=mem.resident, expert_copies=copies, source="given")
        kv = budget.kv_budget_bytes(held)
        out.append({"backend": backend, "state": state, **mem.to_dict(), "kv_budget": kv,
                    "sequences": max(kv, 0) // (budget.kv_bytes_per_token * seq), "usable": budget.usable_bytes})
    return out


def markdown(table: list[dict], seq: int) -> str:
    head = ("| backend | optimizer state | weights | expert copies | optimizer | grads (kept) | grads (update) "
            f"| activations | update peak | KV budget | {seq}-token sequences |")
    lines = [head, "|" + " --- |" * 11]
    for r in table:
        lines.append(f"| {r['backend']} | {r['state']} | {(r['dense_weights'] + r['expert_weights']) / GB:.1f} "
                     f"| {r['expert_copies'] / GB:.1f} | {r['optimizer'] / GB:.1f} | {r['resident_grads'] / GB:.1f} "
                     f"| {r['update_grads'] / GB:.1f} | {r['activations'] / GB:.1f} | {r['update_peak'] / GB:.1f} "
                     f"| {r['kv_budget'] / GB:.1f} | {r['sequences']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
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
