"""Checking and exporting the policy model: shared by the GRPO trainer and the SFT warm start (the
run's `Backend.training_model` builds it).

Lives apart from `trainer.py` so that `rl/sft.py` and the trainer both import it and neither imports
the other.
"""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from elastic.planning.dims import block_owners
from megatron_rl.files.owned_paths import FolderSwap, replace_folder
from megatron_rl.models.hf import check_same_shape, hf_layout, megatron_to_hf, save_hf_checkpoint
from megatron_rl.models.hf_writer import SHARD_BYTES, write_index_and_configs, write_shards
from megatron_rl.models.megatron_weights import canonical_state_dict
from megatron_rl.rl.checkpoint.dcp import CheckpointError
from megatron_rl.trainer_config import TrainerConfig


def check_init(cfg: TrainerConfig) -> None:
    """`init` must be a HuggingFace checkpoint of exactly the configured model shape."""
    if cfg.init is None:
        return
    check_same_shape(cfg.init, cfg.model)


def export_hf(model, model_cfg, path: str | Path, rank: int, world: int, tokenizer=None,
              shard_bytes: int | None = None) -> None:
    """Write the whole model as a HuggingFace folder at `path` from every rank at once
    (models/hf_writer.py): each shard by one rank, the experts it lacks sent to it one tensor at a
    time; nothing gathers every expert onto one device. The same files as `flexfloor export`."""
    shard_bytes = shard_bytes or SHARD_BYTES
    owners = {e: rs[0] for e, rs in block_owners(model_cfg.num_moe_experts, range(world)).items()}
    local = megatron_to_hf({k: v.detach() for k, v in canonical_state_dict(model).items()}, model_cfg)
    layout = hf_layout(model_cfg, model.dtype)
    swap, failed = None, None
    if rank == 0:
        try:
            swap = FolderSwap(Path(path))
        except OSError as e:
            failed = e
    where = [str(swap.tmp) if swap else None]
    dist.broadcast_object_list(where, src=0)
    if where[0] is not None:
        failed = write_shards(local, layout, Path(where[0]), shard_bytes, owners, rank, world,
                              device=next(model.parameters()).device)
        if rank == 0 and failed is None:
            try:
                write_index_and_configs(swap.tmp, layout, shard_bytes, model_cfg, model.dtype, tokenizer)
            except Exception as e:  # noqa: BLE001
                failed = e
    reasons = [None] * world
    dist.all_gather_object(reasons, None if failed is None else _io_reason(failed))
    reason = next((r for r in reasons if r is not None), None)
    if rank == 0 and swap is not None:
        try:
            swap.abort() if reason else swap.commit()
        except OSError as e:
            reason = _io_reason(e)
    reasons = [reason]
    dist.broadcast_object_list(reasons, src=0)
    if reasons[0] is not None:
        raise _export_failed(Path(path), reasons[0])


def write_hf_atomically(model, path: Path, **extras) -> None:
    """`save_hf_checkpoint` into a temporary folder beside `path`, then swapped onto it
    (owned_paths.replace_folder): `path` is either the previous export or the whole new one, never
    half of one (a full disk, a kill). `extras`: `save_hf_checkpoint`'s tokenizer and shard_bytes."""
    try:
        replace_folder(path, lambda tmp: save_hf_checkpoint(model, tmp, **extras))
    except Exception as e:  # noqa: BLE001  (safetensors reports a full disk as its own error type)
        raise _export_failed(path, _io_reason(e)) from None


def _export_failed(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"{path}: cannot write the HuggingFace export ({reason}); "
                           f"{'the previous export is unchanged' if path.exists() else 'nothing was written'}; "
                           "once there is room, `flexfloor export --out DIR` writes it from the last checkpoint")


def _io_reason(e: Exception) -> str:
    import re

    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    found = re.search(r'message: "([^"]+)"', str(e))  # safetensors: IoError(Os { .., message: ".." })
    text = str(e).strip().splitlines()
    return found.group(1) if found else f"{type(e).__name__}: {text[-1][:200] if text else ''}"
