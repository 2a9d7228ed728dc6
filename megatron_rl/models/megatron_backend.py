"""The `megatron` MoE backend: megatron-core's `MoELayer` in place of the plain-PyTorch MoE block.

Same parameters as the `torch` backend (`megatron_rl.models.moe`), so weights move between them:
- `router.weight` [E, D] is megatron's `TopKRouter.weight`; with `moe_router_pre_softmax=False` both
  take the top-k logits and softmax over those k (Qwen3's `norm_topk_prob=True`).
- expert e's `linear_fc1.weight` [2F, D] ([gate; up], SwiGLU) and `linear_fc2.weight` [D, F] are,
  on the EP rank that owns e as its i-th local expert, TEGroupedMLP's `linear_fc1.weight{i}` /
  `linear_fc2.weight{i}` (TransformerEngine grouped GEMM) or SequentialMLP's
  `local_experts.{i}.linear_fc1.weight` / `.linear_fc2.weight`.

Every layer is built against a *passed* `ProcessGroupCollection` (never megatron's global
`parallel_state`), so `elastic/` can rebuild the layers over a smaller, pre-created EP group
(`rebuild_ep`) when ranks leave, and over the full group on restore. Megatron owns experts in
contiguous blocks: EP rank i of n holds experts [i*E/n, (i+1)*E/n), so a shrink stage must use
`elastic.planning.dims.block_owners` and E must divide by the group size.

megatron-core 0.16.1's router and alltoall/flex dispatchers call CUDA directly, so the backend runs
on GPUs only; `require_backend()` says so on a CPU machine. The experts are TEGroupedMLP
when TransformerEngine imports and our grouped-GEMM module otherwise (`expert_kernel`,
`megatron_layers.EXPERTS`; SequentialMLP on request); in the H100 image (FLEXFLOOR_IMAGE=h100) a
TransformerEngine that does not import is an error. The layer can be *built* on CPU
(`device="cpu"`); the tests run it on CPU gloo ranks through a test-only harness that patches
megatron-core's few CUDA calls (tests/megatron_harness.py, docs/cluster.md), which is the one user
of `TEST_DEVICE`.
megatron-core is imported inside the functions that build its objects (here and in
`megatron_layers.py`): it takes seconds to import and warns without TransformerEngine and apex, and
every run imports this module (`megatron_weights.py` reads `MegatronMoE`'s weights under the torch
backend's names), the torch backend's too.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from elastic.planning.dims import LayoutError, block_owners
from elastic.runtime.groups import process_group
from megatron_rl.errors import FlexFloorError
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.megatron_layers import EXPERTS, moe_spec
from megatron_rl.models.moe import MoELayer as TorchMoELayer

DISPATCHERS = ("alltoall", "flex", "allgather")

# (fc1 [2F, D], fc2 [D, F]) of one expert in one layer.
ExpertWeights = tuple[torch.Tensor, torch.Tensor]


# Set by docker/Dockerfile.h100: in that image TransformerEngine is part of the product, so a
# missing or broken one is an error, never a silent fallback to megatron-core's own experts.
IMAGE_ENV = "FLEXFLOOR_IMAGE"


def transformer_engine() -> tuple[str | None, str]:
    """(TransformerEngine's version, or None when it does not import; why it does not)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001  (a broken build raises OSError/RuntimeError, not only ImportError)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformer_engine"), ""
    except PackageNotFoundError:
        return "unknown", ""


def expert_kernel(choice: str = "auto") -> str:
    """The experts megatron-core runs here (`megatron_layers.EXPERTS`): for `auto`, `TEGroupedMLP`
    (TransformerEngine grouped GEMM) when TE imports, else `GroupedMM` (torch._grouped_mm); in the
    H100 image a TE that does not import is an error. `SequentialMLP` (megatron-core's per-expert
    loop) or `GroupedMM` when asked for by name."""
    if choice != "auto":
        if choice not in EXPERTS:
            raise FlexFloorError(f"megatron experts: expected auto or one of {', '.join(EXPERTS)}, got {choice!r}")
        return choice
    te, why = transformer_engine()
    if te is not None:
        return "TEGroupedMLP"
    if os.environ.get(IMAGE_ENV) == "h100":
        raise FlexFloorError(f"{IMAGE_ENV}=h100 but TransformerEngine does not import ({why}); the H100 image "
                             "is broken: rebuild it with docker/build.sh h100")
    return "GroupedMM"


def backend_report() -> dict:
    """What hosts the MoE layers, for the rollout report and the training run's W&B config: the
    expert module this backend builds here (`expert_kernel`)."""
    return {"backend": "megatron", "experts": expert_kernel(), "transformer_engine": transformer_engine()[0]}


# The device megatron-core's layers are built on when CUDA is absent. None in the product (backend
# megatron refuses a machine without CUDA); only the test harness (tests/megatron_harness.py), which
# patches megatron-core's CUDA calls, sets it to "cpu" to run the real layers on gloo ranks.
TEST_DEVICE: str | None = None


def megatron_device() -> str:
    return "cuda" if TEST_DEVICE is None else TEST_DEVICE


def require_backend() -> None:
    """Fail with a user-facing message when this backend cannot run on this machine."""
    if TEST_DEVICE is None and not torch.cuda.is_available():
        raise FlexFloorError(
            "backend 'megatron' builds megatron-core's MoELayer, whose router and token dispatchers "
            "run CUDA kernels (NCCL all-to-all, TransformerEngine grouped GEMM where installed), and this "
            "machine has no CUDA device; use `backend: torch` (the plain-PyTorch MoE with the same weights) on CPU"
        )
    expert_kernel()


def require_cuda_model(model) -> None:
    """megatron-core's layers are built on the current CUDA device: the model must be there."""
    if model.embedding.word_embeddings.weight.device.type != megatron_device():
        raise FlexFloorError("backend 'megatron': the model is not on a CUDA device; run with `device: cuda`")


def megatron_options(dtype: torch.dtype, experts: str = "auto") -> dict:
    """MegatronMoE's options on a GPU: alltoall dispatcher, TE grouped GEMM when TE is there, else
    torch._grouped_mm (`expert_kernel`)."""
    return dict(dispatcher="alltoall", dtype=dtype, expert_module=expert_kernel(experts), device=megatron_device())


def transformer_config(mcfg: MoEModelConfig, *, ep_size: int, dispatcher: str = "alltoall",
                       dtype: torch.dtype = torch.bfloat16, expert_module: str = "TEGroupedMLP",
                       device: str = "cuda"):
    """megatron-core's TransformerConfig for the MoE layers of `mcfg` over an EP group of `ep_size`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dispatcher not in DISPATCHERS:
        raise FlexFloorError(f"moe dispatcher: expected one of {', '.join(DISPATCHERS)}, got {dispatcher!r}")
    try:
        block_owners(mcfg.num_moe_experts, range(ep_size))
    except LayoutError as e:
        raise FlexFloorError(f"megatron backend, an EP group of {ep_size}: {e}") from None
    kwargs = mcfg.transformer_config_kwargs()
    kwargs.update(
        activation_func=F.silu,  # with gated_linear_unit: SwiGLU, as Qwen3's experts
        expert_model_parallel_size=ep_size,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=expert_module == "TEGroupedMLP",
        # Router scores in fp32 whatever the weights' dtype, as the torch backend computes them.
        moe_router_dtype="fp32",
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Qwen3 has no dropout; megatron's default (0.1) would perturb every training forward.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Weights come from the torch backend or a checkpoint, never from megatron's initialisers.
        perform_initialization=False,
        use_cpu_initialization=device == "cpu",
    )
    if dispatcher == "flex":
        kwargs["moe_flex_dispatcher_backend"] = "deepep"
    return TransformerConfig(**kwargs)


def moe_pg_collection(ep_group, self_group, dp_group=None):
    """The ProcessGroupCollection an MoE layer needs: expert parallelism over `ep_group` only.

    `self_group` is a group holding this rank alone (tensor, context, expert-tensor and
    expert-data parallelism are all of size 1 here); `dp_group` defaults to `ep_group`. All groups
    must be created beforehand on every rank, as torch.distributed requires.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    dp_group = ep_group if dp_group is None else dp_group
    return ProcessGroupCollection(
        tp=self_group, cp=self_group, tp_cp=self_group, pp=self_group, expt_tp=self_group,
        expt_dp=self_group, ep=ep_group, tp_ep=ep_group, dp=dp_group, tp_dp_cp=dp_group,
    )


def self_group(rank: int, world: int):
    """The process group of `rank` alone (megatron-core's size-1 tensor, context and expert-data
    groups). Every rank creates all `world` of them at its first call, in the same order, as
    torch.distributed requires of every new group."""
    return [process_group((r,)) for r in range(world)][rank]


class MegatronMoE(nn.Module):
    """megatron-core's MoELayer behind the torch backend's interface: `forward(x_TD) -> y_TD`.

    `experts` must hold the weights of every expert this EP rank owns (more are ignored).
    """

    def __init__(self, mcfg: MoEModelConfig, pg_collection, router_weight: torch.Tensor,
                 experts: Mapping[int, ExpertWeights], *, layer_number: int = 1, dispatcher: str = "alltoall",
                 dtype: torch.dtype = torch.bfloat16, expert_module: str = "TEGroupedMLP", device: str = "cuda"):
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module

        self.options = dict(dispatcher=dispatcher, dtype=dtype, expert_module=expert_module, device=device)
        ep = pg_collection.ep
        owned = [e for e, (r,) in block_owners(mcfg.num_moe_experts, range(ep.size())).items() if r == ep.rank()]
        missing = [e for e in owned if e not in experts]
        if missing:
            raise ValueError(f"EP rank {ep.rank()} of {ep.size()} owns experts {owned}; no weights for {missing}")
        config = transformer_config(mcfg, ep_size=ep.size(), **self.options)
        spec = moe_spec(expert_module, mcfg.num_moe_experts)
        self.layer = build_module(spec, config=config, layer_number=layer_number, pg_collection=pg_collection)
        assert list(self.layer.local_expert_indices) == owned, (self.layer.local_expert_indices, owned)
        self.mcfg, self.layer_number = mcfg, layer_number
        with torch.no_grad():
            self.layer.router.weight.copy_(router_weight)
            for i, e in enumerate(owned):
                fc1, fc2 = self.expert_params(i)
                fc1.copy_(experts[e][0])
                fc2.copy_(experts[e][1])

    def expert_params(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert i's (fc1, fc2): parameters, or views of GroupedMM's stacked parameters."""
        experts = self.layer.experts
        if self.options["expert_module"] == "GroupedMM":
            return experts.expert(i)
        if hasattr(experts, "local_experts"):  # SequentialMLP
            ex = experts.local_experts[i]
            return ex.linear_fc1.weight, ex.linear_fc2.weight
        return getattr(experts.linear_fc1, f"weight{i}"), getattr(experts.linear_fc2, f"weight{i}")  # TEGroupedMLP

    @property
    def local_experts(self) -> list[int]:
        return list(self.layer.local_expert_indices)

    @property
    def router_weight(self) -> torch.Tensor:
        return self.layer.router.weight

    def expert_weights(self) -> dict[int, ExpertWeights]:
        """This rank's experts by global index: the torch backend's layout."""
        out = {}
        for i, e in enumerate(self.local_experts):
            fc1, fc2 = self.expert_params(i)
            out[e] = (fc1.detach(), fc2.detach())
        return out

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        # megatron-core takes [sequence, batch, hidden]: the routed tokens as one sequence.
        y_T1D, _bias = self.layer(x_TD.unsqueeze(1))
        return y_T1D.squeeze(1)


def install_megatron_moe(model, pg_collection, **options) -> None:
    """Replace every layer's torch-backend MoE block of `model` (a Qwen3MoeModel) with MegatronMoE.

    The model must hold (at least) the experts this rank owns in `pg_collection.ep`; the model's
    `moe_layers` then return the MegatronMoE blocks. `options` go to MegatronMoE.
    """
    for i, layer in enumerate(model.decoder.layers):
        torch_moe = layer.mlp
        if not isinstance(torch_moe, TorchMoELayer):
            raise TypeError(f"layer {i} already runs {type(torch_moe).__name__}")
        experts = {e: (torch_moe.experts.get(e).linear_fc1.weight, torch_moe.experts.get(e).linear_fc2.weight)
                   for e in torch_moe.experts.held()}
        layer.mlp = MegatronMoE(model.config, pg_collection, torch_moe.router.weight, experts,
                                layer_number=i + 1, **options)


def uninstall_megatron_moe(model) -> None:
    """The inverse of `install_megatron_moe`: every MegatronMoE block of `model` becomes the torch
    backend's block with the same router and experts (weights copied bit for bit)."""
    for i, layer in enumerate(model.decoder.layers):
        if not isinstance(layer.mlp, MegatronMoE):
            raise TypeError(f"layer {i} runs {type(layer.mlp).__name__}, not MegatronMoE")
        layer.mlp = to_torch_moe(layer.mlp)


def to_torch_moe(moe: MegatronMoE) -> TorchMoELayer:
    """The torch-backend block with the same router and this rank's experts (weights copied)."""
    ref = moe.router_weight
    out = TorchMoELayer(moe.mcfg, moe.local_experts, ref.dtype).to(ref.device)
    with torch.no_grad():
        out.router.weight.copy_(ref)
        for e, (fc1, fc2) in moe.expert_weights().items():
            out.experts.get(e).linear_fc1.weight.copy_(fc1)
            out.experts.get(e).linear_fc2.weight.copy_(fc2)
    return out


def rebuild_ep(model, pg_collection, incoming: Mapping[int, list[ExpertWeights]] | None = None,
               dropped: Iterable[int] = ()) -> None:
    """Rebuild every MegatronMoE layer of `model` over the EP group of `pg_collection`.

    A shrink (or restore) changes which block of experts each member owns; the experts this rank
    held keep their weights unless `dropped`, and `incoming[e]` (one (fc1, fc2) per layer)
    supplies the ones it gains, as moved by `elastic/` (`Plan.transfers`). Only members of the new
    group call this.
    """
    incoming, dropped = incoming or {}, set(dropped)
    for i, layer in enumerate(model.decoder.layers):
        old = layer.mlp
        experts = {e: w for e, w in old.expert_weights().items() if e not in dropped}
        experts.update({e: per_layer[i] for e, per_layer in incoming.items()})
        layer.mlp = MegatronMoE(old.mcfg, pg_collection, old.router_weight.detach(), experts,
                                layer_number=old.layer_number, **old.options)
