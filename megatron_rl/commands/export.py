"""`flexfloor export` (its flags: megatron_rl/cli/export.py): a training checkpoint, verified as a
resume verifies it, written as a HuggingFace folder."""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

from elastic.errors import shorten
from megatron_rl.data.tokenizer import TokenizerConfig, build_tokenizer
from megatron_rl.errors import FlexFloorError
from megatron_rl.files.out_lock import hold_out_dir
from megatron_rl.files.owned_paths import check_export_target
from megatron_rl.files.yaml_input import parse
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rl.checkpoint.dcp import (
    CheckpointError,
    checkpoint_at,
    latest_checkpoint,
    load_model_weights,
    read_state_json,
    vet_checkpoint,
)
from megatron_rl.rl.checkpoint.reads import check_model_shapes
from megatron_rl.rl.model_setup import write_hf_atomically


def run(args) -> int:
    if args.step is not None and args.step < 0:
        raise FlexFloorError(f"--step {args.step}: expected a step >= 0")
    shard_bytes = None if args.shard_gb is None else shard_size(args.shard_gb)
    out = Path(args.out)
    if not (out / "checkpoints").is_dir():
        raise FlexFloorError(f"--out {out}: holds no checkpoints/ folder (not a `flexfloor train` --out)")
    target = Path(args.to) if args.to else out / "hf"
    other_run = check_export_target(target, out)  # before anything is read: what may be replaced
    with hold_out_dir(out, "export"), \
            (hold_out_dir(other_run, "export", "--to") if other_run else contextlib.nullcontext()):
        check_export_target(target, out)  # again, now that no run can change the folders
        step, path = export_checkpoint(out, args.step, target, args.allow_unverified_checkpoint, shard_bytes)
    print(f"exported step {step} ({path}) to {target}")
    return 0


def shard_size(gb: float) -> int:
    """`--shard-gb` in bytes: a positive finite number of GB (0 was ignored, -1 wrote a shard per
    tensor, nan and inf were tracebacks). Below a byte every tensor is a shard of its own; past any
    model (1e300) the whole model is one."""
    if not (math.isfinite(gb) and gb > 0):
        raise FlexFloorError(f"--shard-gb {gb:g}: expected a positive finite number of GB")
    return max(1, int(min(gb * 1e9, 2.0**62)))


def export_checkpoint(out: Path, step: int | None, target: Path, allow_unverified: bool,
                      shard_bytes: int | None = None) -> tuple[int, Path]:
    """Checkpoint `step` of run folder `out` (the latest: None) as a HuggingFace folder `target`,
    verified as `train`'s resume verifies it before a byte of it is parsed."""
    path = checkpoint_at(out, step) if step is not None else latest_checkpoint(out)
    if path is None:
        raise FlexFloorError(f"--out {out}: holds no checkpoint yet")
    metadata = vet_checkpoint(path, allow_unverified)
    # The checkpoint alone says what to build: its shape (trainer_state.json, checked against the
    # shards' metadata before anything is allocated) and its dtype (the metadata), so a config.yaml
    # edited since cannot mislead the export.
    state = read_state_json(path)
    try:
        model_cfg = MoEModelConfig(**state["model"])
    except (TypeError, FlexFloorError) as e:
        raise CheckpointError(f"{path / 'trainer_state.json'}: no usable model shape ({shorten(e)})") from None
    check_model_shapes(path, metadata, model_cfg)
    dtypes = {m.properties.dtype for k, m in metadata.state_dict_metadata.items()
              if k.startswith("model.") and hasattr(m, "properties")}
    if len(dtypes) != 1:
        raise CheckpointError(f"{path}: expected model weights of one dtype, found {sorted(map(str, dtypes))}")
    tokenizer = run_tokenizer(out)
    model = Qwen3MoeModel(model_cfg, None, dtypes.pop())
    load_model_weights(path, model, allow_unverified)
    write_hf_atomically(model, target, tokenizer=tokenizer, shard_bytes=shard_bytes)
    return state["step"], path


def run_tokenizer(out: Path):
    """The tokenizer `out/config.yaml` names (its bos/eos ids and, for an HF one, its files go into
    the export); the default char tokenizer when the run folder has no config.yaml."""
    f = out / "config.yaml"
    if not f.is_file():
        return None
    try:
        section = (parse(f.read_text(encoding="utf-8")[:1 << 20], str(f)) or {}).get("tokenizer") or {}
        return build_tokenizer(TokenizerConfig(**section))
    except (OSError, UnicodeDecodeError, AttributeError, TypeError, FlexFloorError) as e:
        raise FlexFloorError(f"{f}: no usable tokenizer section ({shorten(e)})") from None
