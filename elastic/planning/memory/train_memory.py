"""One training rank's device memory, by part, for both backends (pure Python, bytes).

What stays on the device through the rollout (`resident`, which the planner's `MemoryBudget`
subtracts before the KV cache) and what the update adds on top of it (`update_peak`):

- weights: dense + this rank's experts, in the model dtype (both backends);
- expert copies: what the backend's MoE block keeps beside its experts (the torch backend's stacked
  copy for the grouped GEMM, `ExpertBank.stacked`, built at the first forward and kept through the
  rollout and the update; `MemoryBudget.expert_copies` prices it per held expert in the rollout);
- optimizer state, torch backend: fp32 masters (bf16 only) + two fp32 moments, 12 B/param (8 in
  fp32); ZeRO-1 divides the dense part by the world; offload moves all of it to the host;
- optimizer state, megatron backend (DistributedOptimizer): 12 B/param, the dense part over the
  world (data parallel), the experts' over their data-parallel group (one rank here);
- gradient buffers: torch's are fp32 (bf16) or model-dtype and freed before the rollout (update
  only); megatron's fp32 buffer of every parameter (4 B/param) lives through the rollout;
- activations: the update's micro-batch at its peak (`activation_bytes`: the tensors autograd
  keeps and the largest backward step's, from the model's widths; within 1% of FakeTensor traces);
- KV: what is left, at the plan's batch (`MemoryBudget.kv_budget_bytes`).

So the DistributedOptimizer holds about 16 B per parameter (4 + 12/DP), not the 4 its bf16 moments
alone would be; the replicated torch optimizer holds 12 per parameter on every rank.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from elastic.planning.shape import ModelShape

BackendName = Literal["torch", "megatron"]
OptimizerState = Literal["replicated", "sharded", "offloaded"]


@dataclass(frozen=True)
class OptimizerSetup:
    """How a rank trains, as its memory sees it: the backend (whose optimizer), where the torch
    optimizer's state lives, whether fp32 master copies exist (a bf16/fp16 model, or offload), and
    the bytes of the model's dtype."""

    backend: BackendName
    state: OptimizerState
    masters: bool
    dtype_bytes: int


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of one rank, by part (see the module docstring)."""

    dense_weights: int
    expert_weights: int  # this rank's experts at the training layout
    expert_copies: int  # the MoE block's copies of them (the torch backend's stacked copy)
    optimizer: int  # on the device
    resident_grads: int  # gradient buffers kept through the rollout (megatron's)
    update_grads: int  # gradient buffers that exist only during the update (torch's)
    activations: int  # the update's micro-batch
    reference: int = 0  # a KL reference model's weights

    @property
    def weights(self) -> int:
        return self.dense_weights + self.expert_weights

    @property
    def resident(self) -> int:
        """Beside the weights through the rollout: what `MemoryBudget.resident_bytes` holds."""
        return self.optimizer + self.resident_grads + self.reference

    @property
    def update_peak(self) -> int:
        """The update's peak: weights and their copies, resident state, its gradients and activations."""
        return self.weights + self.expert_copies + self.resident + self.update_grads + self.activations

    def to_dict(self) -> dict:
        return {**asdict(self), "resident": self.resident, "update_peak": self.update_peak}


def optimizer_state_bytes(dense_params: int, expert_params: int, world: int,
                          setup: OptimizerSetup) -> tuple[int, int, int]:
    """(optimizer bytes on the device, gradient bytes kept through the rollout, gradient bytes of
    the update only) for a rank holding `dense_params` replicated and `expert_params` own
    parameters, trained as `setup` says."""
    params = dense_params + expert_params
    if setup.backend == "megatron":  # DistributedOptimizer: 12 B/param sharded over data parallel, fp32 grads kept
        return 12 * dense_params // world + 12 * expert_params, 4 * params, 0
    per_param = 12 if setup.masters else 2 * setup.dtype_bytes
    grads = 4 * params if setup.masters else setup.dtype_bytes * params
    if setup.state == "offloaded":
        return 0, 0, grads
    if setup.state == "sharded":
        return per_param * dense_params // world + per_param * expert_params, 0, grads
    return per_param * params, 0, grads


def layer_saved_bytes(shape: ModelShape) -> int:
    """Bytes per token that autograd saves in one decoder layer's forward (megatron_rl/models/
    qwen3_moe.py and moe.py: what each op's backward reads), for a model of `shape.bytes_per_param`
    bytes whose norms, router and log-softmax compute in fp32 at least (`models.moe.widens`), with
    the token mask training passes."""
    b, D, K, F = shape.bytes_per_param, shape.hidden_size, shape.topk, shape.expert_ffn
    H, G, C = shape.num_attention_heads, shape.num_query_groups, shape.kv_channels
    fp32 = max(4, b)  # an fp32 copy of a narrower input, or the fp32/fp64 input itself
    qkv, qk, heads = G * (H // G + 2) * C, G * (H // G + 1) * C, H * C  # fused projection; q and k heads; q heads
    norm = fp32 * D + fp32 + b * D  # an RMSNorm: its input in fp32, its 1/rms, its normalised rows
    attention = (norm + b * D  # input norm; its output, the qkv projection's input
                 + b * qkv  # the fused projection's output, which v views
                 # q/k norm: an fp32 copy (else a view of qkv), each head's 1/rms, normalised
                 + (4 * qk if b < 4 else 0) + fp32 * (qk // C) + b * qk
                 + b * qk  # q and k after RoPE, which k views
                 + b * heads  # the queries' contiguous copy, as attention takes them
                 + b * heads + 4 * H)  # attention's output (the output projection's input), log-sum-exp
    router = (norm  # pre-MLP norm (its output is read only through the router's fp32 copy and the dispatch)
              + fp32 * D  # the router's input in fp32
              + K * (fp32 + 8 + (b if b < 4 else 0)))  # top-k softmax, expert ids (int64), probs in the dtype
    # Per routed row (K a token), ExpertBank.compute's per-expert path (training's): the rows sorted by
    # expert, their order (int64), fc1's [gate; up], silu(gate), silu(gate) x up (fc2's input), fc2's
    # output (which `index_copy_` saves whole: its backward reads the source's shape), and the unsorted
    # expert outputs the combine multiplies by the probs.
    experts = K * (b * D + 8 + 2 * b * F + b * F + b * F + b * D + b * D)
    return attention + router + experts + 1  # + the token mask the MoE output is masked by


def activation_bytes(shape: ModelShape, tokens: int, recompute: bool, logprob_chunk: int) -> int:
    """The update's activation bytes at its peak for a micro-batch of `tokens` tokens (padding
    included): the torch backend's model (megatron_rl/models/) under `recompute_activations` and
    `logprob_chunk_tokens` (0: none), computing the policy's entropy beside the log-probs as the
    update does (rl/update/train_step.py's `sequence_logprobs`). The gradients accumulated so far
    are not in it (the table counts them apart).

    Through the backward, autograd keeps every layer's saved tensors (`layer_saved_bytes`) or, under
    `recompute`, each layer's input, and the RoPE rows all layers read. The peak is then the larger of:
    - the backward of the last layer (under `recompute`: its saved set, rerun) while the combine's
      gradient is formed: the [T, K, D] gradient of the weighted expert outputs (its K select
      gradients summed), the gradient it passes to the expert outputs and the product the probs'
      gradient sums, and two [T, D] hidden-state gradients;
    - the log-prob head: the final norm's saved tensors and its output (the head's input), and per
      chunk of c tokens (all T when unchunked) the [c, V] logits in the dtype beside the fp32
      log-softmax, its exp and their product (the entropy), or in backward the log-softmax with its
      gradient's zeros and scatter; across chunks the [V, D] output weight's gradient summed so far
      and the [T, D] hidden gradient; or, at the second chunk, the summed [V, D] gradient, the
      chunk's and their sum (autograd sums them out of place: the first is a transposed view).
    Measured against FakeTensor traces of the 30B-A3B slice and a narrower model over recompute,
    chunks, lengths and layers (tools/gpu_slice_trace.py; tests/unit/tools/test_gpu_slice_trace.py).
    """
    b, D, K, V, L = shape.bytes_per_param, shape.hidden_size, shape.topk, shape.vocab_size, shape.num_layers
    T, fp32 = tokens, max(4, b)
    saved = T * layer_saved_bytes(shape) + (4 * shape.num_experts * D if b < 4 else 0)  # + the router's fp32 weight
    kept = T * 2 * b * shape.kv_channels + (L * T * b * D if recompute else L * saved)  # + RoPE cos and sin rows
    layer = (saved if recompute else 0) + T * (3 * K * b * D + 2 * b * D)
    chunk = min(logprob_chunk, T) if logprob_chunk > 0 else T
    logits = (b + 12) * chunk * V  # forward's dtype logits + fp32 log-softmax, exp, product (backward: 12)
    if chunk < T:
        summed = b * V * D + b * T * D  # the output weight's and the hidden states' gradients so far
        logits = max(logits + summed, 3 * b * V * D + b * chunk * D + b * T * D)
    head = T * (fp32 * D + fp32 + 2 * b * D) + logits  # final norm (input, 1/rms, normalised), its output
    return kept + max(layer, head)


def training_memory(*, dense_params: int, expert_params_per_expert: int, experts_held: int, world: int,
                    setup: OptimizerSetup, activations: int, expert_copies: int = 0,
                    reference: bool = False) -> TrainingMemory:
    """One rank's bytes by part, holding `experts_held` experts of `expert_params_per_expert`
    parameters each beside `dense_params` replicated ones, trained as `setup` says; `activations`:
    the update's micro-batch (`activation_bytes`); `expert_copies`: copies of each held expert the
    backend's MoE block keeps (`MemoryBudget.expert_copies`); `reference`: a KL reference model's
    weights too."""
    experts = experts_held * expert_params_per_expert
    optim, resident_grads, update_grads = optimizer_state_bytes(dense_params, experts, world, setup)
    dtype_bytes = setup.dtype_bytes
    weights = (dense_params + experts) * dtype_bytes
    return TrainingMemory(dense_weights=dense_params * dtype_bytes, expert_weights=experts * dtype_bytes,
                          expert_copies=expert_copies * experts * dtype_bytes,
                          optimizer=optim, resident_grads=resident_grads, update_grads=update_grads,
                          activations=activations, reference=weights if reference else 0)
