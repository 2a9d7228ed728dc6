"""What a checkpoint may make this process do: build tensors and DCP's metadata records, nothing else.

A checkpoint folder is data someone else may have written (a shared file system, a downloaded run),
so nothing in it may run code on load:
  - DCP's `.metadata` is a pickle, which torch reads with plain `pickle.load`. `SafeReader` reads it
    through `MetadataUnpickler`, which resolves only the classes DCP's metadata is made of (its
    dataclasses, `torch.Size`, dtypes, paths); any other global is refused in one line naming the
    file and the global, before anything is called.
  - DCP loads non-tensor values (the optimizer's `param_groups`) with torch's loader with weights_only=False;
    `SafeLoadPlanner` loads them with `weights_only=True`. Tensors already load that way.
  - `checksums.json` (rl/checkpoint/checksums.py) detects a changed or torn file; it is no defence against
    someone who can write the folder (they rewrite it too), which is why the loaders above hold
    whatever the checksums say. A checkpoint without `checksums.json` is refused unless the user
    says `checkpoint.allow_unverified: true` (`--allow-unverified-checkpoint`).
"""
from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from elastic.errors import shorten
from megatron_rl.errors import CheckpointError
from megatron_rl.rl.checkpoint.reads import confine_storage, read_capped, read_listing


class UntrustedCheckpoint(CheckpointError):
    """A checkpoint file asks for something a checkpoint never needs (code, an unknown class)."""


# The classes of DCP's metadata module a `.metadata` pickle is made of, by name: a namespace lookup
# would also admit what the module imports (Enum, whose functional API makes classes) and its
# `__class__` (types.ModuleType).
_METADATA_CLASSES = ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                     "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")


def _allowed(module: str, name: str):
    """The object DCP metadata may name, or None. Every entry is a data class or a constructor of
    plain values: nothing here runs a command, opens a file or imports a module."""
    from torch.distributed.checkpoint import filesystem

    if module == dcp_metadata.__name__ and name in _METADATA_CLASSES:
        return getattr(dcp_metadata, name, None)
    if (module, name) == (filesystem.__name__, "_StorageInfo"):
        return filesystem._StorageInfo
    if module == "torch":
        obj = getattr(torch, name, None) if not name.startswith("_") else None
        return obj if isinstance(obj, torch.dtype) or obj is torch.Size else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout  # a name -> torch.layout lookup
    if module == "pathlib" and name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath",
                                        "PureWindowsPath"):
        return getattr(pathlib, name)
    if (module, name) == ("collections", "OrderedDict"):
        import collections

        return collections.OrderedDict
    return None


class MetadataUnpickler(pickle.Unpickler):
    def __init__(self, fh, where: Path):
        super().__init__(fh)
        self.where = where

    def find_class(self, module: str, name: str):
        obj = _allowed(module, name)
        if obj is None:
            raise UntrustedCheckpoint(
                f"{self.where}: refused: the file asks for {shorten(module, 80)}.{shorten(name, 80)}, which checkpoint "
                "metadata never holds (the checkpoint is corrupt or was tampered with); "
                "nothing from it was run")
        return obj


def read_metadata(path: Path, listed: dict | None = None):
    """DCP's `Metadata` of checkpoint folder `path`, read without running anything it names, from a
    regular file of bounded size, with every file it names confined to `path` (rl/checkpoint/reads.py):
    one line naming the file for anything else. `listed`: checksums.json's names (None: not checked)."""
    where = Path(path) / ".metadata"
    data = read_capped(where)
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), where).load()
    except UntrustedCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001  (a torn or foreign pickle raises whatever it hits)
        raise CheckpointError(f"{where}: unreadable checkpoint metadata ({type(e).__name__}: {shorten(e)})") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UntrustedCheckpoint(f"{where}: holds a {shorten(type(metadata).__name__, 80)}, not DCP metadata")
    confine_storage(metadata, Path(path), listed)
    return metadata


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata goes through `read_metadata` above."""

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # per-rank metadata: FlexFloor never writes it
            raise UntrustedCheckpoint(f"{self.path}: asks for per-rank metadata, which FlexFloor never writes")
        metadata = read_metadata(Path(self.path), read_listing(Path(self.path)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor values (numbers, strings, lists) load with `weights_only=True`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
