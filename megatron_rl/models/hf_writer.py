"""Writing a HuggingFace export folder that any loader reads right, from one process or from the ranks.

The folder holds what `save_pretrained` writes for a model of this size:
  - safetensors shards of at most `shard_bytes` (5 GB, the Hub's habit; tests use tiny shards),
    `model.safetensors` alone when one shard holds everything, and `model.safetensors.index.json`
    listing every tensor once;
  - `config.json` with the RoPE base both as transformers 5's `rope_parameters` and as the 4.x
    field `rope_theta` (a 4.x loader, sglang's and vLLM's among them, otherwise silently uses
    10000), and the bos/eos ids;
  - `generation_config.json`, and the tokenizer's own files when the run has an HF tokenizer.
The shards are planned from the model's shape alone (tensor names and sizes in HF order), so the
files are the same, byte for byte, whatever the rank count that writes them. Each shard is written
by one rank, the owner of its first tensor; the tensors of that shard other ranks hold are sent
to it one at a time (point to point), so no rank holds more than its own weights and one shard:
nothing gathers every expert onto one device.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.models.config import MoEModelConfig

SHARD_BYTES = 5 * 10**9
INDEX = "model.safetensors.index.json"


def plan_shards(layout: dict, shard_bytes: int) -> list[list[str]]:
    """Tensor names packed in order into shards of at most `shard_bytes` (a larger tensor alone)."""
    shards, size = [[]], 0
    for name, (shape, dtype) in layout.items():
        n = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def shard_files(count: int) -> list[str]:
    return ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                     for i in range(count)]


def expert_of(name: str) -> int | None:
    """The expert an HF tensor belongs to (`...mlp.experts.<e>.gate_proj.weight`), None if dense."""
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


def write_shards(local: dict[str, torch.Tensor], layout: dict, folder: Path, shard_bytes: int,
                 owner_of_expert: dict[int, int], rank: int, world: int, device=None) -> str | None:
    """This rank's part of writing `layout`'s shards into `folder`: the shards whose first tensor it
    owns (the dense ones are rank 0's), receiving their other tensors from their owners; sending its
    own to the shards' writers. Every rank runs the same sequence of sends and receives, so none
    waits forever; a failed write is returned (not raised) once the sequence is done."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    def owner(name: str) -> int:
        e = expert_of(name)
        return 0 if e is None else owner_of_expert[e]

    failed = None
    shards = plan_shards(layout, shard_bytes)
    for names, file in zip(shards, shard_files(len(shards))):
        writer, tensors = owner(names[0]), {}
        for name in names:
            held = owner(name)
            if rank == writer and held == writer:
                tensors[name] = local[name]
            elif rank == held:
                dist.send(local[name].detach().contiguous(), dst=writer)
            elif rank == writer:
                shape, dtype = layout[name]
                tensors[name] = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(tensors[name], src=held)
        if rank == writer and failed is None:
            try:
                save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(folder / file),
                          metadata={"format": "pt"})
            except Exception as e:  # noqa: BLE001  (safetensors reports a full disk as its own error type)
                failed = e
    return failed


def write_index_and_configs(folder: Path, layout: dict, shard_bytes: int, cfg: MoEModelConfig,
                            dtype: torch.dtype, tokenizer=None) -> None:
    """The index, config.json, generation_config.json and the tokenizer's files (rank 0's part)."""
    shards = plan_shards(layout, shard_bytes)
    files = shard_files(len(shards))
    weight_map = {name: file for names, file in zip(shards, files) for name in names}
    total = sum(math.prod(shape) * dt.itemsize for shape, dt in layout.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                            "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    ids = token_ids(tokenizer)
    hf_cfg = {**cfg.to_hf(), "dtype": str(dtype).removeprefix("torch."), **ids}
    (folder / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({**ids, "do_sample": True}, indent=2))
    hf_tok = getattr(tokenizer, "_tok", None)  # data/tokenizer.py HFTokenizer: its own files
    if hf_tok is not None:
        hf_tok.save_pretrained(str(folder))


def token_ids(tokenizer) -> dict:
    """bos/eos/pad ids of the run's tokenizer (the char tokenizer's when none is given)."""
    if tokenizer is None:
        tokenizer = CharTokenizer()
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    return {k: v for k, v in ids.items() if v is not None}
