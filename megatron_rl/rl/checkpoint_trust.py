"""What a checkpoint may make this process do: build tensors and DCP's metadata records, nothing else.

A checkpoint folder is data someone else may have written (a shared file system, a downloaded run),
so nothing in it may run code on load:
  - DCP's `.metadata` is a pickle, which torch reads with plain `pickle.load`. `SafeReader` reads it
    through `MetadataUnpickler`, which resolves only the classes DCP's metadata is made of (its
    dataclasses, `torch.Size`, dtypes, paths); any other global is refused in one line naming the
    file and the global, before anything is called.
  - DCP loads non-tensor values (the optimizer's `param_groups`) with torch's loader with weights_only=False;
    `SafeLoadPlanner` loads them with `weights_only=True`. Tensors already load that way.
  - `checksums.json` (rl/checkpoint.py) detects a changed or torn file; it is no defence against
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

from megatron_rl.errors import CheckpointError


class UntrustedCheckpoint(CheckpointError):
    """A checkpoint file asks for something a checkpoint never needs (code, an unknown class)."""


def _allowed(module: str, name: str):
    """The object DCP metadata may name, or None. Every entry is a data class or a constructor of
    plain values: nothing here runs a command, opens a file or imports a module."""
    from torch.distributed.checkpoint import filesystem

    if module == dcp_metadata.__name__:
        obj = getattr(dcp_metadata, name, None)
        return obj if isinstance(obj, type) else None
    if (module, name) == (filesystem.__name__, "_StorageInfo"):
        return filesystem._StorageInfo
    if module == "torch":
        obj = getattr(torch, name, None)
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
                f"{self.where}: refused: the file asks for {module[:80]}.{name[:80]}, which checkpoint "
                "metadata never holds (the checkpoint is corrupt or was tampered with); "
                "nothing from it was run")
        return obj


def read_metadata(path: Path):
    """DCP's `Metadata` of checkpoint folder `path`, read without running anything it names."""
    where = Path(path) / ".metadata"
    with open(where, "rb") as fh:
        return MetadataUnpickler(fh, where).load()


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata goes through `MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        where = Path(self.path) / name
        with open(where, "rb") as fh:
            metadata = MetadataUnpickler(fh, where).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UntrustedCheckpoint(f"{where}: holds a {type(metadata).__name__[:80]}, not DCP metadata")
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
