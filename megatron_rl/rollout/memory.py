"""The memory budget the planner prices a rollout against, from the real model and the real device.

The planner (elastic/planning/, pure Python) only does arithmetic on a `MemoryBudget`; this module
fills one in from what the runtime knows:
- weights: the model configuration's exact parameter counts (dense: embeddings, attention, norms,
  router, output layer; one expert: gate, up and down projections over all layers) times the
  bytes of the dtype the rollout runs in;
- expert copies: what the backend's MoE block keeps beside each held expert (the torch backend's
  stacked copy for its grouped GEMM, `ExpertBank.stacked`: one more expert's bytes per held expert);
- KV: layers x (K, V) x KV heads x head dim x dtype bytes per token; in a training rollout plus
  the token's recorded routes, layers x top-k x expert-id bytes (models/routes.py);
- the device: a GPU's total memory (`torch.cuda.get_device_properties`), or the host's RAM
  divided over the ranks that share it;
- resident state: what else stays on the device through the rollout (the trainer's fp32 masters,
  optimizer moments and gradients, `training_state_bytes`).
"""
from __future__ import annotations

import os

import torch

from elastic.planning.memory.kv_unit import TOKENS, KVUnit
from elastic.planning.shape import MemoryBudget
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.routes import route_bytes_per_token
from megatron_rl.rollout.kv.budget import kv_numel


def weight_bytes(mcfg: MoEModelConfig, dtype_bytes: int) -> tuple[int, int]:
    """(dense bytes every rank holds, bytes of one expert over all layers) of `mcfg`'s Qwen3-MoE."""
    D, C, G, H = mcfg.hidden_size, mcfg.kv_channels, mcfg.num_query_groups, mcfg.num_attention_heads
    attention = D * G * (H // G + 2) * C + H * C * D + 2 * C  # fused qkv, output proj, q/k norms
    per_layer = attention + 2 * D + mcfg.num_moe_experts * D  # two RMSNorms, the router
    embeddings = mcfg.vocab_size * D * (2 if mcfg.untie_embeddings_and_output_weights else 1)
    dense = embeddings + mcfg.num_layers * per_layer + D  # + the final norm
    expert = 3 * D * mcfg.moe_ffn_hidden_size * mcfg.num_layers
    return dense * dtype_bytes, expert * dtype_bytes


def kv_bytes_per_token(mcfg: MoEModelConfig, dtype_bytes: int) -> int:
    return kv_numel(mcfg.num_layers, mcfg.num_query_groups, 1, mcfg.kv_channels) * dtype_bytes


def device_memory_bytes(device: torch.device, ranks_on_host: int) -> tuple[int, str]:
    """(bytes one rank may use, where the figure comes from) on `device`."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"{props.name} total memory"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // ranks_on_host, f"host RAM over {ranks_on_host} ranks"


def memory_budget(mcfg: MoEModelConfig, dtype_bytes: int, device: torch.device, ranks_on_host: int,
                  resident_bytes: int = 0, device_bytes: int | None = None,
                  record_routes: bool = False, kv: KVUnit = TOKENS, expert_copies: int = 0) -> MemoryBudget:
    """The budget of one rank running `mcfg` in a `dtype_bytes` dtype on `device`.

    `device_bytes` replaces the measured device memory (planning for a machine other than this one,
    e.g. an 80 GB GPU from a laptop). `record_routes` (a training rollout): every KV position also
    holds its routes (`route_bytes_per_token`), priced with the KV. `kv`: how the run's KV cache
    holds a request (the config's `kv` and `kv_page_size`), what the planner prices it in.
    `expert_copies`: the copies of each held expert the backend's MoE block keeps beside its weights
    (`BackendRules.expert_copies`: the torch backend's stacked copy for the grouped GEMM)."""
    dense, expert = weight_bytes(mcfg, dtype_bytes)
    if device_bytes is None:
        device_bytes, source = device_memory_bytes(device, ranks_on_host)
    else:
        source = "given"
    routes = route_bytes_per_token(mcfg.num_layers, mcfg.moe_router_topk, mcfg.num_moe_experts) if record_routes else 0
    return MemoryBudget(device_bytes=device_bytes, dense_bytes=dense, expert_bytes=expert,
                        kv_bytes_per_token=kv_bytes_per_token(mcfg, dtype_bytes) + routes,
                        resident_bytes=resident_bytes, source=source, route_bytes_per_token=routes, kv=kv,
                        expert_copies=expert_copies)

