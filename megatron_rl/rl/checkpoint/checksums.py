"""`checksums.json`: the sha256 of every file a checkpoint holds, written after every rank's files
are whole and checked before a resume or an export parses any of them.

The shards are hashed in parallel (each rank its share), the metadata and the sidecars by rank 0;
every rank raises the same one line for a file that changed, is missing from the listing, or cannot
be read, so none is left waiting in a collective. The listing detects a changed or torn file, not
someone who can write the folder (rl/checkpoint/trust.py says why the loaders hold regardless).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch.distributed as dist

from elastic.errors import shorten
from megatron_rl.errors import CheckpointError
from megatron_rl.rl.checkpoint.failures import failure_cause
from megatron_rl.rl.checkpoint.reads import CAPS, read_listing, regular_file

CHECKSUMS = "checksums.json"
SIDECARS = ("trainer_state.json", "length_history.jsonl")  # written by rank 0, hashed with the shards


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _shards(path: Path) -> list[Path]:
    # DCP's shards and the megatron optimizer's per-rank files (rl/optim/megatron_train.py OPTIM_FILE).
    return sorted(path.glob("*.distcp")) + sorted(path.glob("megatron_optim.rank*.pt"))


def write_checksums(path: Path, rank: int, group=None) -> None:
    """Every rank hashes its share of the shards (in parallel), rank 0 the metadata and sidecars too;
    rank 0 writes `checksums.json`. A rank that cannot read a file sends its error in the same gather,
    so every rank raises it (none is left waiting in a collective the failed rank never joins)."""
    world = dist.get_world_size(group)
    try:
        mine = {p.name: _sha256(p) for p in _shards(path)[rank::world]}
        if rank == 0:
            mine.update({name: _sha256(path / name) for name in (".metadata", *SIDECARS)})
    except OSError as e:
        mine = f"rank {rank}: {failure_cause(e)}"
    parts = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    failed = next((part for part in parts if isinstance(part, str)), None)
    if failed is not None:
        raise CheckpointError(f"{path}: cannot hash the checkpoint's files ({failed}); the previous "
                              "checkpoint stays in force")
    if rank == 0:
        sums = {k: v for part in parts for k, v in part.items()}
        (path / CHECKSUMS).write_text(json.dumps(sums, indent=1, sort_keys=True))


def verify_checksums(path: Path, allow_unverified: bool = False, only: list[str] | None = None,
                     group=None) -> None:
    """Refuse a checkpoint whose files differ from what was written, or that has a file the listing
    does not cover (every rank checks its share; all raise the same one-line error). A checkpoint
    without `checksums.json` is refused unless `allow_unverified`. `only`: check just these files."""
    listing = path / CHECKSUMS
    sums = read_listing(path)
    if sums is None:
        if allow_unverified:
            return
        raise CheckpointError(f"{listing}: missing, so the checkpoint cannot be verified; if you trust "
                              "where it came from, load it anyway with --allow-unverified-checkpoint "
                              "(checkpoint.allow_unverified=true)")
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    covered = [path / n for n in only] if only is not None else [path / ".metadata", *_shards(path)]
    # Uncovered files pass only with explicit trust: a checkpoint written before checksums.json
    # listed the sidecars (trainer_state.json, length_history.jsonl) resumes that way.
    bad = [f"{f}: not covered by {listing}; if you trust where it came from, load it anyway with "
           "--allow-unverified-checkpoint (checkpoint.allow_unverified=true)"
           for f in covered if f.name not in sums][:1] if rank == 0 and not allow_unverified else []
    for name in sorted(n for n in sums if only is None or n in only)[rank::world]:
        f = path / name
        if Path(name).name != name or name in (".", ".."):
            bad.append(f"{listing}: names {shorten(repr(name), 100)}, which is not a file of the checkpoint")
            continue
        try:
            regular_file(f, CAPS.get(name))  # (a FIFO would hang the hash, /dev/zero never end it)
        except CheckpointError as e:
            bad.append(str(e))
            continue
        if _sha256(f) != sums[name]:
            bad.append(f"{f}: checksum mismatch (the file changed after it was written)")
    found = [bad]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, bad, group=group)
    bad = sorted(b for part in found for b in part)
    if bad:
        raise CheckpointError(f"{bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                              + f"; resume from an earlier checkpoint in {path.parent}")

