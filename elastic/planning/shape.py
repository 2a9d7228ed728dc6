"""The model-and-hardware shape the planner and simulator reason about (no weights, no torch).

Defaults describe Qwen3-30B-A3B in bf16 on 80 GB H100s, the setup arXiv 2611.06984 measured
(from its HuggingFace config.json; the byte figures follow from it):
- 48 layers, 128 experts, top-8, expert FFN 768, hidden 2048, 32 query heads and 4 KV heads of 128,
  vocabulary 151936.
- One expert in one layer: 3 x 2048 x 768 params x 2 B = 9.44 MB; all 48 layers: 453 MB.
- KV cache: 48 layers x 2 (K, V) x 4 KV heads x 128 head dim x 2 B = 96 KiB per token.
- Replicated dense weights (attention, embeddings, router): about 3.1 GB per rank.

This is the one description of a model the planner and the cost model share: the runtime builds
it from the real model's configuration (`MoEModelConfig.shape`), the cost model composes it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

from elastic.planning.memory.kv_unit import TOKENS, KVUnit

GiB = 1024**3


@dataclass(frozen=True)
class MemoryBudget:
    """One device's memory as the runtime knows it, in bytes: what every memory check of the
    planner reads (`Platform.budget`; by default a shape's own, `ModelShape.budget`).

    The runtime builds it from the real model and device (megatron_rl/rollout/memory.py); the
    planner stays pure Python and only does arithmetic on it.
    """

    device_bytes: int  # one rank's device memory (a GPU's total, or host RAM over its ranks)
    dense_bytes: int  # weights every rank holds: attention, norms, router, embeddings
    expert_bytes: int  # one expert over all layers
    kv_bytes_per_token: int
    # State that stays on the device through the rollout beside the weights: a trainer's fp32
    # masters, optimizer moments and gradients. 0 for a rollout on its own.
    resident_bytes: int = 0
    # Share of device_bytes for weights, resident state and KV; activations and allocator slack
    # take the rest (0.9: the vLLM/SGLang `gpu_memory_utilization` neighbourhood).
    utilization: float = 0.9
    source: str = ""  # where device_bytes came from, for messages
    # Of kv_bytes_per_token, what a training rollout's recorded routes take (layers x top-k x id
    # bytes, megatron_rl/models/routes.py): the route buffer has a row per KV position. 0: none.
    route_bytes_per_token: int = 0
    # How the run's KV cache holds a request (kv_unit.py: tokens, whole slots, or pages shared within
    # a GRPO group): every KV check prices a request in the positions that cache gives it.
    kv: KVUnit = TOKENS
    # Copies of each held expert's weights that the MoE block keeps beside them (the torch backend's
    # stacked copy for its grouped GEMM, `ExpertBank.stacked`; `BackendRules.expert_copies`): a held
    # expert takes (1 + expert_copies) x expert_bytes. 0: none (megatron-core's experts are the stack).
    expert_copies: int = 0

    def __post_init__(self):
        for name in ("device_bytes", "expert_bytes", "kv_bytes_per_token"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MemoryBudget.{name}: expected > 0, got {getattr(self, name)}")
        if self.expert_copies < 0:
            raise ValueError(f"MemoryBudget.expert_copies: expected >= 0, got {self.expert_copies}")
        if self.dense_bytes < 0 or self.resident_bytes < 0:
            raise ValueError(f"MemoryBudget.dense_bytes and resident_bytes: expected >= 0, got {self.dense_bytes} "
                             f"and {self.resident_bytes}")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"MemoryBudget.utilization: expected in (0, 1], got {self.utilization}")

    @property
    def usable_bytes(self) -> int:
        return int(self.device_bytes * self.utilization)

    def kv_budget_bytes(self, experts_held: int) -> int:
        """KV bytes a rank may hold while it owns `experts_held` experts (may be negative)."""
        return (self.usable_bytes - self.dense_bytes - self.resident_bytes
                - experts_held * self.expert_bytes * (1 + self.expert_copies))

    def describe(self, experts_held: int) -> str:
        """Where a rank holding `experts_held` experts spends its memory, for messages."""
        resident = f" + {self.resident_bytes / 1e9:.2f} GB resident state" if self.resident_bytes else ""
        if self.route_bytes_per_token:
            resident += (f"; KV {self.kv_bytes_per_token} B/token, of which {self.route_bytes_per_token} B "
                         "recorded routes")
        copies = f", x{1 + self.expert_copies} with their stacked copies" if self.expert_copies else ""
        return (f"{experts_held} experts ({experts_held * self.expert_bytes / 1e9:.2f} GB{copies}) + "
                f"{self.dense_bytes / 1e9:.2f} GB dense weights{resident} of "
                f"{self.usable_bytes / 1e9:.2f} GB usable ({self.utilization:.0%} of "
                f"{self.device_bytes / 1e9:.2f} GB{', ' + self.source if self.source else ''})")


@dataclass(frozen=True)
class ModelShape:
    name: str = "qwen3-30b-a3b@h100-80g"
    num_experts: int = 128
    topk: int = 8
    num_layers: int = 48
    hidden_size: int = 2048
    expert_ffn: int = 768
    bytes_per_param: int = 2
    # None: the K and V of every layer, num_layers x 2 x num_query_groups x kv_channels x
    # bytes_per_param; a training rollout's budget adds the recorded routes (`MemoryBudget`).
    kv_bytes_per_token: int | None = None
    dense_bytes: int = int(3.1e9)
    memory_per_rank_bytes: int = 80 * 10**9
    # Share of device memory the runtime may use (activations, allocator slack and CUDA graphs
    # take the rest); 0.9 is the vLLM/SGLang default `gpu_memory_utilization` neighbourhood.
    memory_utilization: float = 0.9
    ranks_per_node: int = 8
    # Attention and vocabulary: what a decode step reads and computes beside the experts.
    num_attention_heads: int = 32
    num_query_groups: int = 4
    kv_channels: int = 128
    vocab_size: int = 151936

    def __post_init__(self):
        if self.kv_bytes_per_token is None:
            object.__setattr__(self, "kv_bytes_per_token", self.num_layers * 2 * self.num_query_groups
                               * self.kv_channels * self.bytes_per_param)
        for name in ("num_experts", "topk", "num_layers", "hidden_size", "expert_ffn",
                     "bytes_per_param", "kv_bytes_per_token", "memory_per_rank_bytes",
                     "ranks_per_node", "num_attention_heads", "num_query_groups", "kv_channels",
                     "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name}: expected > 0, got {getattr(self, name)}")
        if self.dense_bytes < 0:
            raise ValueError(f"ModelShape.dense_bytes: expected >= 0, got {self.dense_bytes}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(
                f"ModelShape.memory_utilization must be in (0, 1], got {self.memory_utilization}"
            )
        if self.topk > self.num_experts:
            raise ValueError(f"ModelShape.topk ({self.topk}) exceeds num_experts ({self.num_experts})")

    @property
    def expert_params_per_layer(self) -> int:
        """Gate, up and down projections of one expert in one layer."""
        return 3 * self.hidden_size * self.expert_ffn

    @property
    def expert_bytes(self) -> int:
        """One expert across all layers (what a shrink moves per expert)."""
        return self.expert_params_per_layer * self.bytes_per_param * self.num_layers

    @property
    def step_dense_params(self) -> int:
        """Weights every decode step of a rank with tokens reads: per layer the attention (q and o
        of hidden x heads x head dim, k and v of hidden x KV heads x head dim) and the router, plus
        the LM head (the input embedding is read a row per token, the norms are negligible)."""
        d, c = self.hidden_size, self.kv_channels
        attention = 2 * d * self.num_attention_heads * c + 2 * d * self.num_query_groups * c
        return self.num_layers * (attention + d * self.num_experts) + self.vocab_size * d

    @property
    def step_dense_bytes(self) -> int:
        return self.step_dense_params * self.bytes_per_param

    @property
    def attn_flops_per_kv_token(self) -> int:
        """QK^T and PV over one cached token: 2 x 2 flops x query heads x head dim x layers."""
        return 4 * self.num_attention_heads * self.kv_channels * self.num_layers

    @cached_property
    def budget(self) -> MemoryBudget:
        """This shape's memory as a `MemoryBudget` (the planner's default when the runtime gives none)."""
        return MemoryBudget(self.memory_per_rank_bytes, self.dense_bytes, self.expert_bytes,
                            self.kv_bytes_per_token, utilization=self.memory_utilization, source=self.name)

    @property
    def usable_bytes(self) -> int:
        return self.budget.usable_bytes

    def kv_budget_bytes(self, experts_held: int) -> int:
        """KV bytes a rank may hold while it owns `experts_held` experts (may be negative)."""
        return self.budget.kv_budget_bytes(experts_held)

    def to_dict(self) -> dict:
        return asdict(self)


QWEN3_30B_A3B_H100 = ModelShape()

# Named shapes for `--model`; add a shape here rather than inventing numbers at a call site.
SHAPES = {
    QWEN3_30B_A3B_H100.name: QWEN3_30B_A3B_H100,
    "qwen3-30b-a3b@h200-141g": ModelShape(
        name="qwen3-30b-a3b@h200-141g", memory_per_rank_bytes=141 * 10**9
    ),
}
