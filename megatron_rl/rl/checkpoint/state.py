"""What a checkpoint's DCP shards hold, by the optimizer a run trains with: the model's weights and
the optimizer's state keyed by parameter name, in the form each optimizer keeps them.

  - replicated AdamW: `model` and `optim` (torch's `get_state_dict`);
  - mixed precision (rl/optim/mixed_precision.py): the bf16 `model`, the fp32 `master` weights and their
    `optim` state;
  - ZeRO-1 / offload (rl/optim/zero.py): `model`, and this rank's shard of `master` and `optim`, by name,
    so a checkpoint saved on W ranks loads on any rank count;
  - megatron-core: the weights under the torch backend's names; its optimizer keeps its own files
    (rl/optim/megatron_train.py).
The frozen reference model, when a KL term is used, is `ref`.
"""
from __future__ import annotations

from torch.distributed.checkpoint.state_dict import get_state_dict

from megatron_rl.models.megatron_weights import canonical_state_dict
from megatron_rl.rl.optim.megatron_train import MegatronOptimizer
from megatron_rl.rl.optim.zero import ShardedOptimizer


def is_megatron(optimizer) -> bool:
    return isinstance(optimizer, MegatronOptimizer)


def is_sharded(optimizer) -> bool:
    return isinstance(optimizer, ShardedOptimizer)


def dcp_state(model, optimizer, ref_model) -> dict:
    """The state DCP writes (and, but for a sharded optimizer, loads into in place)."""
    if is_megatron(optimizer):
        # The weights under the torch backend's names (DCP loads into these tensors in place); the
        # optimizer's sharded state is megatron-core's own files (MegatronOptimizer.save).
        return {"model": canonical_state_dict(model)}
    if is_sharded(optimizer):  # ZeRO-1 / offload (rl/optim/zero.py): this rank's shard, by name
        state = {"model": model.state_dict(), **optimizer.sharded_state()}
    elif getattr(optimizer, "masters", None) is None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:  # mixed precision (rl/optim/mixed_precision.py): fp32 masters and their AdamW state, by name
        master_sd, optim_sd = get_state_dict(optimizer.masters, optimizer.inner)
        state = {"model": model.state_dict(), "master": master_sd, "optim": optim_sd}
    if ref_model is not None:
        state["ref"] = ref_model.state_dict()
    return state


def drop_unsaved_optimizer_state(state: dict, saved_keys: set[str]) -> list[str]:
    """AdamW creates a parameter's state at its first gradient, so an expert that no token reached
    has none, while `get_state_dict` makes state for every parameter of a fresh optimizer. Load only
    what was saved; returns the parameters whose state must then be forgotten again."""
    prefix = "optim.state."
    # Keys are "optim.state.<parameter fqn>.<exp_avg|exp_avg_sq|step>".
    saved = {k[len(prefix):].rsplit(".", 1)[0] for k in saved_keys if k.startswith(prefix)}
    optim_state = state["optim"].get("state", {})
    absent = [fqn for fqn in optim_state if fqn not in saved]
    for fqn in absent:
        del optim_state[fqn]
    return absent


def forget_state(optimizer, model, fqns: list[str]) -> None:
    """The optimizer holds no state for `fqns`, as when the checkpoint was written."""
    params = dict(model.named_parameters())
    for fqn in fqns:
        optimizer.state.pop(params[fqn], None)
