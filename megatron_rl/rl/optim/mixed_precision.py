"""fp32 master weights for a model that computes in bf16: the optimizer of a low-precision model.

The guarantees of megatron-core's `DistributedOptimizer` with `bf16=True` and
`grad_reduce_in_fp32=True`, for our expert-parallel model and on any device (CPU included):

- every low-precision parameter has an fp32 *master* under the same name;
- gradients accumulate in fp32 on the master's `.grad`: a post-accumulate-grad hook moves each
  backward pass's bf16 gradient onto the master and frees it, so micro-batch accumulation, the
  dense all-reduce and the global-norm clip all run in fp32 (`grad_params` names what to reduce);
- the inner optimizer (AdamW) steps on the masters, so its state is fp32;
- after the step every model parameter is re-copied from its master (round to nearest).

Why it matters: AdamW's first steps move a weight by about lr. At lr 1e-6 a weight of magnitude
0.02 needs a change of 2^-7 x 0.02 / 2 = 8e-5 before bf16 rounds it anywhere, so direct bf16
AdamW leaves it unchanged step after step; its master accumulates the steps until the bf16 copy
moves.

Layout: a master lives where its parameter lives. Dense masters and their AdamW state are
replicated like the dense weights (every rank steps identically on all-reduced fp32 gradients);
expert masters live only on the expert's owner: 12 bytes per dense parameter on every rank. The
sharded optimizer (rl/optim/zero.py, ZeRO-1, the default for more than one rank) keeps the dense state
of 1/world of them instead, under the same rules.

The masters form a module (`MasterWeights`) with the model's parameter names, so checkpoints key
master weights and optimizer state by name exactly as they key the model's (rl/checkpoint/state.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from elastic.planning.memory.train_memory import OptimizerSetup, optimizer_state_bytes
from megatron_rl.models.params import is_expert_param
from megatron_rl.rl.optim.megatron_train import MegatronOptimizer

# fp16 would also need loss scaling, which is not here; the trainer offers bfloat16 only.
LOW_PRECISION = (torch.bfloat16, torch.float16)


def needs_masters(model: nn.Module) -> bool:
    """True when any trainable parameter is bf16/fp16 (fp32 and fp64 models step directly)."""
    return any(p.dtype in LOW_PRECISION for p in model.parameters() if p.requires_grad)


class MasterWeights(nn.Module):
    """fp32 copies of `named` parameters, registered under the same dotted names."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        super().__init__()
        for name, p in named:
            *path, leaf = name.split(".")
            mod: nn.Module = self
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, nn.Module())
                mod = mod._modules[part]
            mod.register_parameter(leaf, nn.Parameter(p.detach().to(torch.float32).clone()))


class MixedPrecisionOptimizer:
    """An optimizer over fp32 masters of `model`'s parameters; see the module docstring.

    `make_inner(params)` builds the optimizer that steps on the masters (e.g. torch AdamW). Use as
    a torch optimizer: `zero_grad()`, backward passes, reduce/clip `grad_params(...)`, `step()`.
    """

    def __init__(self, model: nn.Module, make_inner: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.masters = MasterWeights(named)
        by_name = dict(self.masters.named_parameters())
        self.pairs = [(p, by_name[n]) for n, p in named]
        self.inner = make_inner([m for _, m in self.pairs])
        self._hooks = [p.register_post_accumulate_grad_hook(_move_grad_to(m)) for p, m in self.pairs]

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def named_grad_params(self) -> list[tuple[str, nn.Parameter]]:
        """The masters by parameter name: where the fp32 gradients are reduced and clipped."""
        return list(self.masters.named_parameters())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p, _ in self.pairs:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        self.copy_to_model()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round every master into its model parameter (after a step or a checkpoint load)."""
        for p, m in self.pairs:
            p.copy_(m)

    def close(self) -> None:
        """Remove the gradient hooks (the model then accumulates its own gradients again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _move_grad_to(master: nn.Parameter):
    def hook(p: torch.Tensor) -> None:
        g = p.grad.to(torch.float32)
        if master.grad is None:
            master.grad = g
        else:
            master.grad.add_(g)
        p.grad = None
    return hook


def grad_params(model: nn.Module, optimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor whose `.grad` the optimizer steps on): the masters under mixed precision,
    else the model's own parameters."""
    if isinstance(optimizer, MixedPrecisionOptimizer):
        return optimizer.named_grad_params()
    return list(model.named_parameters())


def training_state_bytes(model: nn.Module, optimizer, ref_model: nn.Module | None = None, world: int = 1) -> int:
    """Bytes of training state that stay on the device through the rollout beside the model's
    weights (elastic/planning/memory/train_memory.py has the table):
    - the replicated torch optimizer: fp32 masters and AdamW's two fp32 moments under mixed
      precision (12 bytes per parameter), else the two moments in the parameters' dtype;
    - ZeRO-1 / offload (rl/optim/zero.py): what its shard keeps on the device (none under offload);
    - megatron-core's DistributedOptimizer: 12 bytes per parameter over the data-parallel group
      (the world for dense weights, one rank for experts) plus its fp32 gradient buffer, which
      lives through the rollout: about 16 bytes per parameter;
    plus the KL reference model's weights. (The torch backend frees its gradients before the
    rollout.) AdamW allocates its moments at the first step; they are counted from the start, as
    the planner must hold room for them."""
    # ZeRO-1 (rl/optim/zero.py, which builds on this file) knows its own shard: asked, not imported.
    if hasattr(optimizer, "device_state_bytes"):
        total = optimizer.device_state_bytes()
    elif isinstance(optimizer, MegatronOptimizer):
        named = list(model.named_parameters())
        dense = sum(p.numel() for n, p in named if not is_expert_param(n))
        experts = sum(p.numel() for n, p in named if is_expert_param(n))
        setup = OptimizerSetup("megatron", "sharded", True, 2)
        optim, grads, _ = optimizer_state_bytes(dense, experts, world, setup)
        total = optim + grads
    else:
        tensors = 3 if isinstance(optimizer, MixedPrecisionOptimizer) else 2
        total = sum(tensors * p.numel() * p.element_size() for _, p in grad_params(model, optimizer))
    if ref_model is not None:
        total += sum(p.numel() * p.element_size() for p in ref_model.parameters())
    return total
