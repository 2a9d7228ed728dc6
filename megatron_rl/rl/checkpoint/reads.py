"""Checkpoint reads confined to the step folder and bounded in size, in `train` and `export` alike.

A checkpoint folder may have been written by someone else (rl/checkpoint/trust.py says what it may
make us run: nothing). This module says what it may make us read:
  - only regular files directly in the step folder: no FIFO (which hangs a reader forever), device
    (`/dev/zero`: 2^40 bytes), symlink or path out of it. DCP's metadata names the file of every
    tensor (`_StorageInfo.relative_path`), and torch opens whatever it names; here each must be a
    plain name, listed in `checksums.json` when there is one, and its byte range inside the file;
  - small files (`trainer_state.json`, `.metadata`, `checksums.json`, `length_history.jsonl`) with a
    size cap checked before a byte is read, and their JSON with a depth cap (files/json_input.py);
  - tensors no larger than the bytes that hold them, and, for `export`, which builds the model from
    the checkpoint's own shape, the shape checked against the metadata before any allocation.
Every refusal is one line naming the file.
"""
from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import torch

from elastic.errors import shorten
from megatron_rl.errors import CheckpointError
from megatron_rl.files.json_input import loads
from megatron_rl.models.qwen3_moe import Qwen3MoeModel

CAPS = {"trainer_state.json": 1 << 24, ".metadata": 1 << 30, "checksums.json": 1 << 24,
        "length_history.jsonl": 1 << 32}
BYTES_ENTRY_CAP = 1 << 24  # a non-tensor value (the optimizer's lr, betas): a few hundred bytes
TENSOR_SLACK = 1 << 20  # torch.save's zip framing around a tensor's bytes


def regular_file(f: Path, cap: int | None = None) -> int:
    """The size of `f`, a regular file (not followed through a symlink) of at most `cap` bytes."""
    try:
        st = os.lstat(f)
    except OSError as e:
        raise CheckpointError(f"{f}: {'missing' if e.errno == 2 else 'unreadable (' + e.strerror + ')'}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a folder" if stat.S_ISDIR(st.st_mode) else "a device or socket")
        raise CheckpointError(f"{f}: is {kind}, not a regular file; a checkpoint holds only files")
    if cap is not None and st.st_size > cap:
        raise CheckpointError(f"{f}: {st.st_size} bytes, more than the {cap} a checkpoint's {f.name} may hold")
    return st.st_size


def read_capped(f: Path) -> bytes:
    """The bytes of small checkpoint file `f`, checked (regular, capped) before it is opened."""
    cap = CAPS[f.name]
    regular_file(f, cap)
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            return fh.read(cap + 1)[:cap]
    except OSError as e:
        raise CheckpointError(f"{f}: unreadable ({e.strerror})") from None


def read_listing(path: Path) -> dict[str, str] | None:
    """Checkpoint `path`'s `checksums.json` (file name -> sha256), or None when there is none."""
    listing = path / "checksums.json"
    if not os.path.lexists(listing):
        return None
    try:
        sums = loads(read_capped(listing))
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise ValueError("expected a mapping of file name to sha256")
    except ValueError as e:
        raise CheckpointError(f"{listing}: unreadable ({shorten(e)})") from None
    return sums


def confine_storage(metadata, path: Path, listed: dict | None) -> None:
    """Every file DCP `metadata` would read: a plain name in `path`, listed (when `listed` is not
    None), a regular file holding the byte range named, of a size the value it holds explains."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where, sizes = path / ".metadata", {}
    for idx, info in (getattr(metadata, "storage_data", None) or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in (".", "..", ".metadata"):
            raise CheckpointError(f"{where}: names the file {shorten(repr(name), 120)}, which is not a file of "
                                  f"the checkpoint {path}")
        if listed is not None and name not in listed:
            raise CheckpointError(f"{where}: names {shorten(repr(name), 120)}, which checksums.json does not list")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where}: {shorten(name, 120)} asks for transforms "
                                  f"{list(info.transform_descriptors)[:3]}, which FlexFloor never writes")
        if name not in sizes:
            sizes[name] = regular_file(path / name)
        offset, length = info.offset, info.length
        if not (type(offset) is int and type(length) is int and 0 <= offset and 0 <= length
                and offset + length <= sizes[name]):
            raise CheckpointError(f"{path / name}: the metadata names bytes {offset!r}+{length!r} of a "
                                  f"{sizes[name]}-byte file (torn or tampered with)")
        md = metadata.state_dict_metadata.get(getattr(idx, "fqn", None))
        if isinstance(md, TensorStorageMetadata):
            chunk = _chunk_bytes(md, idx)
            if chunk is None or not chunk <= length <= chunk + TENSOR_SLACK:
                raise CheckpointError(f"{path / name}: {length} bytes hold the tensor {shorten(idx.fqn, 120)}, "
                                      f"whose shape {list(md.size)[:6]} needs {chunk}")
        elif length > BYTES_ENTRY_CAP:
            raise CheckpointError(f"{path / name}: a {length}-byte value for {shorten(str(idx.fqn), 120)}, "
                                  f"more than the {BYTES_ENTRY_CAP} a non-tensor value may take")


def _chunk_bytes(md, idx) -> int | None:
    import math

    itemsize = md.properties.dtype.itemsize
    for chunk in md.chunks:
        if idx.offset is None or tuple(chunk.offsets) == tuple(idx.offset):
            return math.prod(chunk.sizes) * itemsize
    return None


def check_model_shapes(path: Path, metadata, cfg) -> None:
    """The model weights of `metadata` are exactly those of shape `cfg` (read from the checkpoint's
    trainer_state.json), checked before a model of that shape is built: a shape that does not match
    its shards (a rewritten `num_layers: 200000`) is refused instead of allocated."""
    saved = {k[len("model."):]: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}
    with torch.device("meta"):  # one layer: every layer has the same tensors
        one = Qwen3MoeModel(dataclasses.replace(cfg, num_layers=1)).state_dict()
    per_layer = {k: tuple(v.shape) for k, v in one.items() if k.startswith("decoder.layers.0.")}
    rest = {k: tuple(v.shape) for k, v in one.items() if not k.startswith("decoder.layers.0.")}
    where = f"{path / 'trainer_state.json'}: the model shape"
    if len(saved) != len(rest) + cfg.num_layers * len(per_layer):
        raise CheckpointError(f"{where} ({cfg.num_layers} layers) implies "
                              f"{len(rest) + cfg.num_layers * len(per_layer)} weight tensors; the shards "
                              f"hold {len(saved)}")
    for i in range(cfg.num_layers):
        want = {**({} if i else rest), **{k.replace("layers.0.", f"layers.{i}.", 1): s for k, s in per_layer.items()}}
        for k, s in want.items():
            if saved.get(k) != s:
                raise CheckpointError(f"{where} implies {k} of shape {list(s)}; the shards hold "
                                      f"{list(saved[k]) if k in saved else 'none'}")
