"""Training checkpoints with `torch.distributed.checkpoint`, and resume.

`DIR/checkpoints/step_<N>/` holds:
  - the DCP shards: model and optimizer state keyed by parameter name (expert parameters by their
    global index, so each is written once by its owner and a resume may use another rank count),
    under mixed precision the fp32 master weights too (the optimizer state is then the masters'),
    and the frozen reference model when a KL term is used;
  - `trainer_state.json`: step, data position (epoch, position), the seed from which every random
    stream of step N+1 is derived (sampling is keyed by (seed, step, prompt, sample) and torch's
    generator is re-seeded from (seed, step) every step), and the model's shape;
  - `length_history.jsonl`: the response lengths of every rollout so far, in the trace format the
    planner reads.
`DIR/checkpoints/latest` names the newest complete checkpoint; it is replaced (atomically) only
after every rank has finished writing, so a crash during a save leaves the previous one in force.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.trace import Trace, TraceError, read_trace, write_trace
from megatron_rl.errors import FlexFloorError
from megatron_rl.models.config import MoEModelConfig


class CheckpointError(FlexFloorError):
    pass


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    pointer = Path(out_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / "trainer_state.json").exists():
        raise CheckpointError(f"{pointer}: names {path}, which holds no trainer_state.json")
    return path


def _megatron(optimizer) -> bool:
    from megatron_rl.rl.megatron_train import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)


def _state(model, optimizer, ref_model) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if _megatron(optimizer):
        # The weights under the torch backend's names (DCP loads into these tensors in place); the
        # optimizer's sharded state is megatron-core's own files (MegatronOptimizer.save).
        from megatron_rl.models.megatron_weights import canonical_state_dict

        return {"model": canonical_state_dict(model)}
    masters = getattr(optimizer, "masters", None)
    if masters is None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:  # mixed precision (rl/mixed_precision.py): fp32 masters and their AdamW state, by name
        master_sd, optim_sd = get_state_dict(masters, optimizer.inner)
        state = {"model": model.state_dict(), "master": master_sd, "optim": optim_sd}
    if ref_model is not None:
        state["ref"] = ref_model.state_dict()
    return state


def save_checkpoint(out_dir: str | Path, step: int, model, optimizer, ref_model,
                    trainer_state: dict, history: Trace, rank: int) -> Path:
    import torch.distributed.checkpoint as dcp

    root = Path(out_dir) / "checkpoints"
    path = root / f"step_{step:06d}"
    dcp.save(_state(model, optimizer, ref_model), checkpoint_id=str(path))
    if _megatron(optimizer):
        optimizer.save(path, rank)
    if rank == 0:
        (path / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        write_trace(history.records, path / "length_history.jsonl")
    dist.barrier()  # every shard and sidecar is on disk before `latest` moves
    if rank == 0:
        tmp = root / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, root / "latest")
    dist.barrier()
    return path


def read_trainer_state(path: Path, model_cfg: MoEModelConfig) -> tuple[dict, Trace]:
    """The sidecars of checkpoint `path`; refuses a checkpoint of another model shape."""
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}/trainer_state.json: unreadable ({e})") from None
    saved, want = state.get("model", {}), model_cfg.to_dict()
    diff = sorted(k for k in set(saved) | set(want) if saved.get(k) != want.get(k))
    if diff:
        shown = ", ".join(f"{k}: checkpoint {saved.get(k)!r}, config {want.get(k)!r}" for k in diff[:4])
        raise CheckpointError(f"{path}: checkpoint is for another model shape ({shown})")
    hist_file = path / "length_history.jsonl"
    try:
        history = read_trace(hist_file) if hist_file.stat().st_size else Trace([], str(hist_file))
    except (OSError, TraceError) as e:
        raise CheckpointError(f"{hist_file}: {e}") from None
    return state, history


def load_checkpoint(path: Path, model, optimizer, ref_model) -> None:
    """Load model, optimizer (and reference) state in place from the DCP shards at `path`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer, ref_model)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # DCP wraps per-rank failures in its own exception types  # noqa: BLE001
        raise CheckpointError(f"{path}: cannot load the checkpoint shards ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if _megatron(optimizer):
        optimizer.load(path, dist.get_rank())
        return
    if "master" in state:
        set_state_dict(optimizer.masters, optimizer.inner, model_state_dict=state["master"],
                       optim_state_dict=state["optim"])
        model.load_state_dict(state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if ref_model is not None:
        ref_model.load_state_dict(state["ref"])


def gather_full_state(model, rank: int, world: int) -> dict[str, torch.Tensor] | None:
    """Every parameter on rank 0 (dense from rank 0, each expert from its owner), for HF export.

    Rank 0 needs the whole model in host memory (about 61 GB for Qwen3-30B-A3B in bf16).
    """
    from megatron_rl.models.megatron_weights import canonical_state_dict

    mine = canonical_state_dict(model)  # either MoE backend, under the torch backend's names
    local = {k: v.detach().cpu() for k, v in mine.items() if ".local_experts." in k}
    parts: list = [None] * world if rank == 0 else None
    dist.gather_object(local, parts, dst=0)
    if rank != 0:
        return None
    full = {k: v.detach().cpu() for k, v in mine.items()}
    for p in parts:
        full.update(p)
    return full
