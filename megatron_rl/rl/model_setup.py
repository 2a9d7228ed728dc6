"""Building, checking and exporting the policy model: shared by the GRPO trainer and the SFT warm start.

Lives apart from `trainer.py` so that `rl/sft.py` and the trainer both import it and neither imports
the other.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from elastic.planning.plan import block_owners
from megatron_rl.errors import FlexFloorError
from megatron_rl.models.qwen3_moe import DTYPES
from megatron_rl.rl.checkpoint import CheckpointError, gather_full_state
from megatron_rl.trainer_config import TrainerConfig


def check_init(cfg: TrainerConfig) -> None:
    """`init` must be a HuggingFace checkpoint of exactly the configured model shape."""
    if cfg.init is None:
        return
    from megatron_rl.models.hf import check_same_shape

    check_same_shape(cfg.init, cfg.model)


def build_model(cfg: TrainerConfig, rank: int, world: int, device: torch.device | None = None):
    """This rank's model on `device`: dense weights and the experts Megatron's contiguous blocks give
    it. On the device before the megatron backend is installed, which needs it on CUDA."""
    from megatron_rl.models.moe import LocalDispatcher
    from megatron_rl.models.qwen3_moe import Qwen3MoeModel
    from megatron_rl.parallel.ep_dispatch import AllToAllDispatcher

    owners = block_owners(cfg.model.num_moe_experts, range(world))
    held = [e for e, rs in owners.items() if rank in rs]
    dtype = DTYPES[cfg.dtype]
    if cfg.init is not None:
        from megatron_rl.models.hf import load_hf_checkpoint

        model = load_hf_checkpoint(cfg.init, dtype, experts=held)
    else:
        model = Qwen3MoeModel(cfg.model, held, dtype)
        model.init_weights(cfg.seed)
    if device is not None:
        model.to(device)
    model.recompute_activations = cfg.recompute_activations
    model.set_dispatcher(LocalDispatcher() if world == 1 else
                         AllToAllDispatcher(dist.group.WORLD, [owners[e][0] for e in sorted(owners)]))
    if cfg.backend == "megatron":
        from megatron_rl.models.megatron_backend import install_megatron_moe, megatron_options, require_cuda_model
        from megatron_rl.rl.megatron_train import training_groups

        require_cuda_model(model)
        install_megatron_moe(model, training_groups(rank, world), **megatron_options(dtype))
    return model


def export_hf(model, model_cfg, path: str | Path, rank: int, world: int) -> None:
    """Write the whole model (every rank's experts) as a HuggingFace checkpoint from rank 0."""
    from megatron_rl.models.qwen3_moe import Qwen3MoeModel

    full = gather_full_state(model, rank, world)
    failed = None
    if rank == 0:
        whole = Qwen3MoeModel(model_cfg, None, model.dtype)
        whole.load_state_dict(full, strict=True)
        try:
            write_hf_atomically(whole, Path(path))
        except FlexFloorError as e:
            failed = e
    dist.barrier()
    if failed is not None:
        raise failed


def write_hf_atomically(model, path: Path, **extras) -> None:
    """`save_hf_checkpoint` into a temporary folder beside `path`, then swapped onto it
    (owned_paths.replace_folder): `path` is either the previous export or the whole new one, never
    half of one (a full disk, a kill). `extras`: what `save_hf_checkpoint` writes besides weights."""
    from megatron_rl.models.hf import save_hf_checkpoint
    from megatron_rl.owned_paths import replace_folder

    try:
        replace_folder(path, lambda tmp: save_hf_checkpoint(model, tmp, **extras))
    except Exception as e:  # noqa: BLE001  (safetensors reports a full disk as its own error type)
        raise CheckpointError(f"{path}: cannot write the HuggingFace export ({_io_reason(e)}); "
                              f"{'the previous export is unchanged' if path.exists() else 'nothing was written'}; "
                              "once there is room, `flexfloor export --out DIR` writes it from the "
                              "last checkpoint") from None


def _io_reason(e: Exception) -> str:
    import re

    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    found = re.search(r'message: "([^"]+)"', str(e))  # safetensors: IoError(Os { .., message: ".." })
    text = str(e).strip().splitlines()
    return found.group(1) if found else f"{type(e).__name__}: {text[-1][:200] if text else ''}"
