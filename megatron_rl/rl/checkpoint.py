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
Loading never runs code from the folder (rl/checkpoint_trust.py): a checkpoint is data.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastic.errors import shorten
from elastic.trace import Trace, TraceError, read_trace, write_trace
from megatron_rl.errors import CheckpointError
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.rl.checkpoint_reads import CAPS, read_capped, read_listing, regular_file

SIDECARS = ("trainer_state.json", "length_history.jsonl")  # written by rank 0, hashed with the shards


def step_dir(out_dir: str | Path, step: int) -> Path:
    """The folder of step `step`'s checkpoint in run folder `out_dir` (every writer and reader names it here)."""
    return Path(out_dir) / "checkpoints" / f"step_{step:06d}"


def checkpoint_at(out_dir: str | Path, step: int) -> Path:
    """`out_dir`'s checkpoint of step `step`, or one line listing the steps it has."""
    path = step_dir(out_dir, step)
    if not (path / "trainer_state.json").is_file():
        have = sorted(int(p.name[5:]) for p in path.parent.glob("step_[0-9]*")
                      if p.name[5:].isdigit() and (p / "trainer_state.json").is_file())
        raise CheckpointError(f"{path}: no checkpoint of step {step} (checkpoints of steps: "
                              f"{', '.join(map(str, have[-20:])) or 'none'})")
    return path


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    pointer = Path(out_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    try:
        regular_file(pointer, 200)  # (a FIFO would hang the read)
        name = pointer.read_bytes()[:200].decode("ascii").strip()
    except CheckpointError as e:
        raise CheckpointError(f"{e}; it should hold a name such as step_000010") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{pointer}: unreadable ({getattr(e, 'strerror', None) or 'not a step name'}); "
                              "it should hold a name such as step_000010") from None
    if not (name.startswith("step_") and name[5:].isdigit()):
        raise CheckpointError(f"{pointer}: names {shorten(repr(name), 60)}, not a checkpoint such as step_000010")
    path = pointer.parent / name
    if not os.path.lexists(path / "trainer_state.json"):  # (what it is, the reader checks)
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
    if _sharded(optimizer):  # ZeRO-1 / offload (rl/zero.py): this rank's shard, by name
        state = {"model": model.state_dict(), **optimizer.sharded_state()}
    elif getattr(optimizer, "masters", None) is None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:  # mixed precision (rl/mixed_precision.py): fp32 masters and their AdamW state, by name
        master_sd, optim_sd = get_state_dict(optimizer.masters, optimizer.inner)
        state = {"model": model.state_dict(), "master": master_sd, "optim": optim_sd}
    if ref_model is not None:
        state["ref"] = ref_model.state_dict()
    return state


def _sharded(optimizer) -> bool:
    from megatron_rl.rl.zero import ShardedOptimizer

    return isinstance(optimizer, ShardedOptimizer)


def save_checkpoint(out_dir: str | Path, step: int, model, optimizer, ref_model,
                    trainer_state: dict, history: Trace, rank: int, keep: tuple[int, int] | None = None) -> Path:
    """`keep`: (keep_last, keep_every) of rl/checkpoint_retention.py, applied once this checkpoint
    is verified and `latest` names it; None keeps every checkpoint."""
    import torch.distributed.checkpoint as dcp

    from megatron_rl.owned_paths import refuse_symlinks_out

    path = step_dir(out_dir, step)
    root = path.parent
    refuse_symlinks_out(root, path, root / "latest")
    try:
        dcp.save(_state(model, optimizer, ref_model), checkpoint_id=str(path))
        if _megatron(optimizer):
            optimizer.save(path, rank)
        if rank == 0:  # before the checksums, which cover them (they are read before the shards)
            write_sidecars(path, {"step": step, **trainer_state}, history.records)
        dist.barrier()  # every rank's files are whole before the checksums hash them
        write_checksums(path, rank)
    except (OSError, CheckpointException) as e:
        raise CheckpointError(save_failure(path, e)) from None
    dist.barrier()  # every shard and sidecar is on disk before `latest` moves
    if keep is not None:  # what a resume reads first, read back, before anything older may go
        verify_checksums(path, only=[".metadata", *SIDECARS])
    publish(path, rank, keep)
    return path


def write_sidecars(path: Path, trainer_state: dict, records: list) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    write_trace(records, path / "length_history.jsonl")


def save_failure(path: Path, e: BaseException) -> str:
    return f"{path}: cannot write the checkpoint ({_cause(e)}); the previous checkpoint stays in force"


def publish(path: Path, rank: int, keep: tuple[int, int] | None, group=None) -> None:
    """Rank 0 points `latest` at the verified checkpoint `path`, then applies retention."""
    if rank == 0:
        point_latest(path)
        if keep is not None:
            from megatron_rl.rl.checkpoint_retention import prune

            try:
                prune(path.parent, path, *keep)
            except OSError as e:
                print(f"[train] {path.parent}: could not remove an old checkpoint ({_cause(e)}); "
                      "the run goes on", file=sys.stderr)
    dist.barrier(group=group)


def point_latest(path: Path) -> None:
    """`checkpoints/latest` names checkpoint `path`, replaced atomically (never a torn name)."""
    from megatron_rl.owned_paths import write_file_atomically

    write_file_atomically(path.parent / "latest", path.name)


def read_trainer_state(path: Path, model_cfg: MoEModelConfig) -> tuple[dict, Trace]:
    """The sidecars of checkpoint `path`; refuses a checkpoint of another model shape."""
    state = read_state_json(path)
    saved, want = state["model"], model_cfg.to_dict()
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


def read_state_json(path: Path) -> dict:
    """Checkpoint `path`'s trainer_state.json, with the fields a resume reads checked (one line
    naming the file for anything else: torn, binary, nested without end, fields of the wrong type)."""
    from megatron_rl.json_input import loads

    f = path / "trainer_state.json"
    try:
        state = loads(read_capped(f))  # a regular file of at most 16 MiB, checked before reading
    except ValueError as e:  # (JSON and UTF-8 errors are ValueErrors)
        raise CheckpointError(f"{f}: unreadable ({shorten(e)})") from None
    # A stopped SFT warm start (rl/sft.py) saves step 0 with its own position instead of the data's.
    sft = isinstance(state, dict) and "sft_step" in state
    types = {"step": int, "model": dict, **({"sft_step": int, "sft_data": dict} if sft else {"data": dict})}
    bad = [k for k, tp in types.items() if not isinstance(state, dict) or not isinstance(state.get(k), tp)
           or isinstance(state.get(k), bool)]
    if bad:
        raise CheckpointError(f"{f}: field {bad[0]!r} missing or not {types[bad[0]].__name__}")
    if state["step"] < 0:
        raise CheckpointError(f"{f}: step {state['step']} is negative")
    return state


def load_checkpoint(path: Path, model, optimizer, ref_model, allow_unverified: bool = False) -> None:
    """Load model, optimizer (and reference) state in place from the DCP shards at `path`.
    `allow_unverified`: load a checkpoint that has no checksums.json (else refused)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from megatron_rl.rl.checkpoint_trust import SafeLoadPlanner, SafeReader

    verify_checksums(path, allow_unverified)
    keys = _saved_keys(path)  # the metadata is vetted before DCP reads it
    if _sharded(optimizer):  # the names this rank owns now, whatever the rank count that saved
        state = {"model": model.state_dict(), **optimizer.load_request(keys)}
        if ref_model is not None:
            state["ref"] = ref_model.state_dict()
    else:
        state = _state(model, optimizer, ref_model)
    absent = [] if _megatron(optimizer) or _sharded(optimizer) else _drop_unsaved_optimizer_state(state, keys)
    # A ZeRO-1 checkpoint (rl/zero.py) keeps no param_groups: the config's hyperparameters hold.
    saved_groups = any(k.startswith("optim.param_groups.") for k in keys)
    groups = None if saved_groups else state.get("optim", {}).pop("param_groups", None)
    try:
        dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)),
                 planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP's is a BaseException)
        raise CheckpointError(f"{path}: cannot load the checkpoint shards ({_cause(e)})") from None
    if _megatron(optimizer):
        optimizer.load(path, dist.get_rank())
    elif _sharded(optimizer):
        optimizer.finish_load(state)
    else:
        if groups is not None:
            state["optim"]["param_groups"] = groups
        # Under mixed precision the fp32 masters (rl/mixed_precision.py) hold the optimizer's
        # parameters, by the model's names; the bf16 weights are loaded as saved.
        holder, inner = (optimizer.masters, optimizer.inner) if "master" in state else (model, optimizer)
        if "master" in state:
            model.load_state_dict(state["model"])
        set_model_state_dict(holder, state["master" if "master" in state else "model"])
        # Not strict: a parameter without optimizer state in the checkpoint gets none (see below).
        set_optimizer_state_dict(holder, inner, state["optim"], options=StateDictOptions(strict=False))
        _forget_state(inner, holder, absent)
    if ref_model is not None:
        ref_model.load_state_dict(state["ref"])


def vet_checkpoint(path: Path, allow_unverified: bool = False):
    """What `train`'s driver and `export` check before anything of the checkpoint is parsed: the
    checksum listing is there (or waived) and matches the metadata and the sidecars, and the
    metadata reads through the restricted unpickler with every file it names confined to the
    folder (rl/checkpoint_reads.py). The shards' hashes are left to the loaders (the ranks hash them
    in parallel as they load). Returns the metadata."""
    from megatron_rl.rl.checkpoint_trust import read_metadata

    verify_checksums(path, allow_unverified, only=[".metadata", *SIDECARS])
    return read_metadata(path, read_listing(path))


def load_model_weights(path: Path, model, allow_unverified: bool = False) -> None:
    """Only the model's weights of checkpoint `path`, into `model` (which holds every expert), in
    one process with no process group: what `flexfloor export` needs."""
    import torch.distributed.checkpoint as dcp

    from megatron_rl.rl.checkpoint_trust import SafeLoadPlanner, SafeReader

    verify_checksums(path, allow_unverified)
    _saved_keys(path)  # the metadata is vetted before DCP reads it
    import warnings

    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)),
                     planner=SafeLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP's is a BaseException)
        raise CheckpointError(f"{path}: cannot load the checkpoint shards ({_cause(e)})") from None
    model.load_state_dict(state["model"])


# ---- faults: optimizer state that was never created, corrupt shards, loader errors -------------
CHECKSUMS = "checksums.json"


def _saved_keys(path: Path) -> set[str]:
    from megatron_rl.rl.checkpoint_trust import read_metadata

    return set(read_metadata(path, read_listing(path)).state_dict_metadata)


def _drop_unsaved_optimizer_state(state: dict, saved_keys: set[str]) -> list[str]:
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


def _forget_state(optimizer, model, fqns: list[str]) -> None:
    """The optimizer holds no state for `fqns`, as when the checkpoint was written."""
    params = dict(model.named_parameters())
    for fqn in fqns:
        optimizer.state.pop(params[fqn], None)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _shards(path: Path) -> list[Path]:
    # DCP's shards and the megatron optimizer's per-rank files (rl/megatron_train.py OPTIM_FILE).
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
        mine = f"rank {rank}: {_cause(e)}"
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


def _cause(e: BaseException) -> str:
    """One line for a loader/writer failure: the underlying OS error (file and reason: 'No space left
    on device' on a full disk) when there is one, else the innermost exception's first line."""
    if isinstance(e, CheckpointException):
        for exc in (pair[0] if isinstance(pair, tuple) else pair for pair in e.failures.values()):
            e = exc
            break
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
        if e.__cause__ is None and e.__context__ is None:
            break
        e = e.__cause__ or e.__context__
    if isinstance(e, EOFError):
        return "a shard ends early (truncated file)"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"
