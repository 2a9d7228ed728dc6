"""megatron-core's MoE layer as the `megatron` backend builds it: the module spec, the expert modules,
and the three defects of megatron-core 0.16.1 that would stop its first run.

Experts (`EXPERTS`, reported as `backend_report()["experts"]`):
- `TEGroupedMLP`: TransformerEngine's grouped GEMM, wherever TransformerEngine imports;
- `GroupedMM`: `GroupedMMExperts` below, one `torch._grouped_mm` per matmul over all local experts
  (torchtitan's GroupedExperts), so the backend without TransformerEngine is not a Python loop;
- `SequentialMLP`: megatron-core's loop over per-expert MLPs, still selectable (`experts=`).

Defects of 0.16.1 fixed here, each covered by a harness test (tests/distributed/test_megatron_harness.py):
1. `moe_utils.te_general_gemm` is defined only when TransformerEngine imports, so the router's
   first forward raises NameError without it (0.19 defines it as None): `define_te_general_gemm`.
2. A step with zero tokens (an EP rank with no live request still runs every layer's collectives)
   fails in the router's `.view(0, 1, -1)`: `ZeroTokenRouter.gating` computes that case itself.
9. The alltoall dispatcher hands its split sizes to `all_to_all_single` as host arrays (numpy on
   CUDA, tensors on CPU), not the lists torch's binding is typed for: `ListSplitsAlltoAll` turns
   them into lists.
Found by the harness as well: the allgather dispatcher gathers into megatron's global memory
buffer, which only `parallel_state.initialize_model_parallel` creates and this project (passed
process groups, never megatron's globals) never calls: `FlexFloorMoELayer` creates it. That
dispatcher also gathers equal token counts from every EP rank, so it suits training batches of
one shape, not generation (the product runs alltoall).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXPERTS = ("TEGroupedMLP", "GroupedMM", "SequentialMLP")


def define_te_general_gemm() -> None:
    """Defect 1: the router's gating reads `moe_utils.te_general_gemm`, which 0.16.1 binds only in
    its TransformerEngine import; None is what 0.19 sets without TE (the plain torch.mm path)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _router_class():
    from megatron.core.transformer.moe.router import TopKRouter

    class ZeroTokenRouter(TopKRouter):
        """TopKRouter that takes zero tokens (defect 2): megatron's gating views its output as
        `(*input.shape[:-1], -1)`, ambiguous for zero rows; the empty logits are computed here, as
        the same fp32 product, so the dispatchers' collectives still run on this rank."""

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            if input.numel():
                return super().gating(input)
            dtype = torch.float32 if self.config.moe_router_dtype == "fp32" else input.dtype
            logits = input.reshape(0, input.shape[-1]).to(dtype) @ self.weight.to(dtype).t()
            return logits.reshape(*input.shape[:-1], self.weight.shape[0])

    return ZeroTokenRouter


def _alltoall_class():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    class ListSplitsAlltoAll(MoEAlltoAllTokenDispatcher):
        """Defect 9: megatron moves the alltoall split sizes to the host as numpy arrays
        (`maybe_move_tensor_to_cpu(as_numpy=True)`), which `all_to_all_single` rejects; as lists
        they are what the binding takes. (`output_splits_tp` stays: megatron calls `.tolist()` on it.)"""

        def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
            out = super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
            for name in ("input_splits", "output_splits"):
                value = getattr(self, name)
                # Host values only (numpy after the device-to-host point): a CUDA tensor stays.
                if hasattr(value, "tolist") and not (torch.is_tensor(value) and value.is_cuda):
                    setattr(self, name, [int(n) for n in value.tolist()])
            return out

    return ListSplitsAlltoAll


def _layer_class():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class FlexFloorMoELayer(MoELayer):
        """megatron-core's MoELayer with the alltoall dispatcher of `ListSplitsAlltoAll`, and the
        allgather one's global memory buffer."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
            from megatron.core import parallel_state

            super().__init__(config, submodules, layer_number, pg_collection)
            if config.moe_token_dispatcher_type == "allgather" and parallel_state._GLOBAL_MEMORY_BUFFER is None:
                parallel_state._set_global_memory_buffer()
            if config.moe_token_dispatcher_type == "alltoall":
                self.token_dispatcher = _alltoall_class()(self.num_local_experts, self.local_expert_indices,
                                                          config=config, pg_collection=pg_collection)

    return FlexFloorMoELayer


def _grouped_class():
    from megatron.core.transformer.module import MegatronModule

    class GroupedMMExperts(MegatronModule):
        """The local experts as two stacked weights, `fc1_E2FD` [E, 2F, D] ([gate; up], SwiGLU) and
        `fc2_EDF` [E, D, F], run with one `torch._grouped_mm` per matmul over the tokens megatron's
        dispatcher has sorted by local expert (`tokens_per_expert` rows each). The router's
        probabilities scale the SwiGLU output in their fp32 before fc2, as megatron's expert MLP
        applies `per_token_scale`. Parameters are expert-parallel (`allreduce=False`) as
        megatron-core's own expert layers mark them when EP > 1."""

        def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None):
            super().__init__(config=config)
            E, D, F_ = num_local_experts, config.hidden_size, config.moe_ffn_hidden_size
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            self.num_local_experts = E
            self.fc1_E2FD = nn.Parameter(torch.empty(E, 2 * F_, D, dtype=config.params_dtype, device=device))
            self.fc2_EDF = nn.Parameter(torch.empty(E, D, F_, dtype=config.params_dtype, device=device))
            for p in (self.fc1_E2FD, self.fc2_EDF):
                p.allreduce = config.expert_model_parallel_size == 1

        def forward(self, x_TD: torch.Tensor, tokens_per_expert: torch.Tensor, probs_T: torch.Tensor):
            h_T2F = self._matmul(x_TD, self.fc1_E2FD, tokens_per_expert)
            gate_TF, up_TF = h_T2F.chunk(2, dim=-1)
            a_TF = (F.silu(gate_TF) * up_TF * probs_T.unsqueeze(-1)).to(x_TD.dtype)
            return self._matmul(a_TF, self.fc2_EDF, tokens_per_expert), None

        @staticmethod
        def _matmul(x_TI: torch.Tensor, w_EOI: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
            """Rows of expert e times w[e]^T. CUDA's grouped GEMM takes bf16 only (sm90); another
            dtype on CUDA gets one matmul per expert (the same products)."""
            if x_TI.device.type == "cuda" and x_TI.dtype != torch.bfloat16:
                parts = torch.split(x_TI, tokens_per_expert.tolist())
                return torch.cat([x @ w.t() for x, w in zip(parts, w_EOI)])
            offs_E = torch.cumsum(tokens_per_expert.to(x_TI.device), 0).to(torch.int32)
            return torch._grouped_mm(x_TI, w_EOI.transpose(1, 2), offs=offs_E)

        def expert(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.fc1_E2FD[i], self.fc2_EDF[i]

    return GroupedMMExperts


_classes: dict = {}


def megatron_class(name: str):
    """The classes above, built once megatron-core is imported (the product imports it lazily)."""
    if not _classes:
        define_te_general_gemm()
        _classes.update(ZeroTokenRouter=_router_class(), MoELayer=_layer_class(), GroupedMM=_grouped_class())
    return _classes[name]


def moe_spec(experts: str, num_experts: int):
    """The MoE layer's ModuleSpec: megatron's spec for TE or local SequentialMLP experts, or ours
    (GroupedMM) in its place, with this module's router and layer classes."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    if experts not in EXPERTS:
        raise ValueError(f"experts: expected one of {', '.join(EXPERTS)}, got {experts!r}")
    te = experts == "TEGroupedMLP"
    spec = get_moe_module_spec(use_te=te, num_experts=num_experts, moe_grouped_gemm=te)
    spec.module = megatron_class("MoELayer")
    spec.submodules.router = megatron_class("ZeroTokenRouter")
    if experts == "GroupedMM":
        spec.submodules.experts = ModuleSpec(module=megatron_class("GroupedMM"))
    return spec
