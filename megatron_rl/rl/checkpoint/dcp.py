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
Loading never runs code from the folder (rl/checkpoint/trust.py): a checkpoint is data. What the
shards hold for each optimizer is rl/checkpoint/state.py's; `checksums.json`, rl/checkpoint/checksums.py's.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastic.errors import shorten
from elastic.trace import Trace, TraceError, read_trace, write_trace
from megatron_rl.errors import CheckpointError
from megatron_rl.files.json_input import loads
from megatron_rl.files.owned_paths import refuse_symlinks_out, write_file_atomically
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.rl.checkpoint.checksums import SIDECARS, verify_checksums, write_checksums
from megatron_rl.rl.checkpoint.failures import failure_cause, save_failure
from megatron_rl.rl.checkpoint.reads import read_capped, read_listing, regular_file
from megatron_rl.rl.checkpoint.retention import prune
from megatron_rl.rl.checkpoint.state import (
    dcp_state,
    drop_unsaved_optimizer_state,
    forget_state,
    is_megatron,
    is_sharded,
)
from megatron_rl.rl.checkpoint.trust import SafeLoadPlanner, SafeReader, read_metadata


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
        raise CheckpointError(f"{e}; expected a file holding a name such as step_000010") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{pointer}: expected a name such as step_000010, got an unreadable file "
                              f"({getattr(e, 'strerror', None) or 'not a step name'})") from None
    if not (name.startswith("step_") and name[5:].isdigit()):
        raise CheckpointError(f"{pointer}: expected a checkpoint name such as step_000010, "
                              f"got {shorten(repr(name), 60)}")
    path = pointer.parent / name
    if not os.path.lexists(path / "trainer_state.json"):  # (what it is, the reader checks)
        raise CheckpointError(f"{pointer}: names {path}, which holds no trainer_state.json")
    return path


def save_checkpoint(out_dir: str | Path, step: int, model, optimizer, ref_model,
                    trainer_state: dict, history: Trace, rank: int, keep: tuple[int, int] | None = None) -> Path:
    """`keep`: (keep_last, keep_every) of rl/checkpoint/retention.py, applied once this checkpoint
    is verified and `latest` names it; None keeps every checkpoint."""
    import torch.distributed.checkpoint as dcp

    path = step_dir(out_dir, step)
    root = path.parent
    refuse_symlinks_out(root, path, root / "latest")
    try:
        dcp.save(dcp_state(model, optimizer, ref_model), checkpoint_id=str(path))
        if is_megatron(optimizer):
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


def publish(path: Path, rank: int, keep: tuple[int, int] | None, group=None) -> None:
    """Rank 0 points `latest` at the verified checkpoint `path`, then applies retention."""
    if rank == 0:
        point_latest(path)
        if keep is not None:
            try:
                prune(path.parent, path, *keep)
            except OSError as e:
                print(f"[train] {path.parent}: could not remove an old checkpoint ({failure_cause(e)}); "
                      "the run goes on", file=sys.stderr)
    dist.barrier(group=group)


def point_latest(path: Path) -> None:
    """`checkpoints/latest` names checkpoint `path`, replaced atomically (never a torn name)."""
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
    f = path / "trainer_state.json"
    try:
        state = loads(read_capped(f))  # a regular file of at most 16 MiB, checked before reading
    except ValueError as e:  # (JSON and UTF-8 errors are ValueErrors)
        raise CheckpointError(f"{f}: unreadable ({shorten(e)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f}: expected an object of fields, got a JSON {type(state).__name__}")
    # A stopped SFT warm start (rl/sft.py) saves step 0 with its own position instead of the data's.
    sft = "sft_step" in state
    types = {"step": int, "model": dict, **({"sft_step": int, "sft_data": dict} if sft else {"data": dict})}
    bad = [k for k, tp in types.items() if not isinstance(state.get(k), tp) or isinstance(state.get(k), bool)]
    if bad:
        got = type(state[bad[0]]).__name__ if bad[0] in state else "nothing (the field is missing)"
        raise CheckpointError(f"{f}: field {bad[0]!r}: expected {types[bad[0]].__name__}, got {got}")
    if state["step"] < 0:
        raise CheckpointError(f"{f}: field 'step': expected a step >= 0, got {state['step']}")
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

    verify_checksums(path, allow_unverified)
    keys = _saved_keys(path)  # the metadata is vetted before DCP reads it
    if is_sharded(optimizer):  # the names this rank owns now, whatever the rank count that saved
        state = {"model": model.state_dict(), **optimizer.load_request(keys)}
        if ref_model is not None:
            state["ref"] = ref_model.state_dict()
    else:
        state = dcp_state(model, optimizer, ref_model)
    absent = [] if is_megatron(optimizer) or is_sharded(optimizer) else drop_unsaved_optimizer_state(state, keys)
    # A ZeRO-1 checkpoint (rl/optim/zero.py) keeps no param_groups: the config's hyperparameters hold.
    saved_groups = any(k.startswith("optim.param_groups.") for k in keys)
    groups = None if saved_groups else state.get("optim", {}).pop("param_groups", None)
    try:
        dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)),
                 planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP's is a BaseException)
        raise CheckpointError(f"{path}: cannot load the checkpoint shards ({failure_cause(e)})") from None
    if is_megatron(optimizer):
        optimizer.load(path, dist.get_rank())
    elif is_sharded(optimizer):
        optimizer.finish_load(state)
    else:
        if groups is not None:
            state["optim"]["param_groups"] = groups
        # Under mixed precision the fp32 masters (rl/optim/mixed_precision.py) hold the optimizer's
        # parameters, by the model's names; the bf16 weights are loaded as saved.
        holder, inner = (optimizer.masters, optimizer.inner) if "master" in state else (model, optimizer)
        if "master" in state:
            model.load_state_dict(state["model"])
        set_model_state_dict(holder, state["master" if "master" in state else "model"])
        # Not strict: a parameter without optimizer state in the checkpoint gets none (see below).
        set_optimizer_state_dict(holder, inner, state["optim"], options=StateDictOptions(strict=False))
        forget_state(inner, holder, absent)
    if ref_model is not None:
        ref_model.load_state_dict(state["ref"])


def vet_checkpoint(path: Path, allow_unverified: bool = False):
    """What `train`'s driver and `export` check before anything of the checkpoint is parsed: the
    checksum listing is there (or waived) and matches the metadata and the sidecars, and the
    metadata reads through the restricted unpickler with every file it names confined to the
    folder (rl/checkpoint/reads.py). The shards' hashes are left to the loaders (the ranks hash them
    in parallel as they load). Returns the metadata."""
    verify_checksums(path, allow_unverified, only=[".metadata", *SIDECARS])
    return read_metadata(path, read_listing(path))


def load_model_weights(path: Path, model, allow_unverified: bool = False) -> None:
    """Only the model's weights of checkpoint `path`, into `model` (which holds every expert), in
    one process with no process group: what `flexfloor export` needs."""
    import torch.distributed.checkpoint as dcp

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
        raise CheckpointError(f"{path}: cannot load the checkpoint shards ({failure_cause(e)})") from None
    model.load_state_dict(state["model"])


def _saved_keys(path: Path) -> set[str]:
    return set(read_metadata(path, read_listing(path)).state_dict_metadata)
