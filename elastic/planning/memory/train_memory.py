"""One training rank's device memory, by part, for both backends (pure Python, bytes).

What stays on the device through the rollout (`resident`, which the planner's `MemoryBudget`
subtracts before the KV cache) and what the update adds on top of it (`update_peak`):

- weights: dense + this rank's experts, in the model dtype (both backends);
- optimizer state, torch backend: fp32 masters (bf16 only) + two fp32 moments, 12 B/param (8 in
  fp32); ZeRO-1 divides the dense part by the world; offload moves all of it to the host;
- optimizer state, megatron backend (DistributedOptimizer): 12 B/param, the dense part over the
  world (data parallel), the experts' over their data-parallel group (one rank here);
- gradient buffers: torch's are fp32 (bf16) or model-dtype and freed before the rollout (update
  only); megatron's fp32 buffer of every parameter (4 B/param) lives through the rollout;
- activations: the update's micro-batch (`activation_bytes`, an estimate);
- KV: what is left, at the plan's batch (`MemoryBudget.kv_budget_bytes`).

So the DistributedOptimizer holds about 16 B per parameter (4 + 12/DP), not the 4 its bf16 moments
alone would be; the replicated torch optimizer holds 12 per parameter on every rank.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

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
        """The update's peak: weights, resident state, its gradients and activations."""
        return self.weights + self.resident + self.update_grads + self.activations

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


def activation_bytes(tokens: int, num_layers: int, hidden: int, topk: int, expert_ffn: int, vocab: int,
                     dtype_bytes: int, recompute: bool, logprob_chunk: int) -> int:
    """An estimate of the update's activations for a micro-batch of `tokens` tokens.

    Per token and layer, autograd keeps about 16 hidden-sized tensors (norm inputs and outputs,
    q/k/v, attention output, residuals) and three per routed expert (gate, up, their product);
    `recompute` keeps only each layer's input and one layer's full set; the fp32 logits and their
    gradient exist for `logprob_chunk` tokens at a time (all tokens when 0)."""
    per_layer = tokens * (16 * hidden + 3 * topk * expert_ffn) * dtype_bytes
    kept = tokens * hidden * dtype_bytes * num_layers + per_layer if recompute else per_layer * num_layers
    logits = 2 * 4 * vocab * (min(tokens, logprob_chunk) if logprob_chunk > 0 else tokens)
    return kept + logits


def training_memory(*, dense_params: int, expert_params_per_expert: int, experts_held: int, world: int,
                    setup: OptimizerSetup, activations: int, reference: bool = False) -> TrainingMemory:
    """One rank's bytes by part, holding `experts_held` experts of `expert_params_per_expert`
    parameters each beside `dense_params` replicated ones, trained as `setup` says; `activations`:
    the update's micro-batch (`activation_bytes`); `reference`: a KL reference model's weights too."""
    experts = experts_held * expert_params_per_expert
    optim, resident_grads, update_grads = optimizer_state_bytes(dense_params, experts, world, setup)
    dtype_bytes = setup.dtype_bytes
    weights = (dense_params + experts) * dtype_bytes
    return TrainingMemory(dense_weights=dense_params * dtype_bytes, expert_weights=experts * dtype_bytes,
                          optimizer=optim, resident_grads=resident_grads, update_grads=update_grads,
                          activations=activations, reference=weights if reference else 0)
