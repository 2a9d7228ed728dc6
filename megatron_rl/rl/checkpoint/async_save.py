"""Checkpoint saves that overlap the next training step (`checkpoint.async_save`).

The state is copied to host memory synchronously (so the next step may change the weights), then
a background thread writes the DCP shards, the sidecars and `checksums.json`, verifies them, and only
then points `latest` at the checkpoint and applies retention (rl/checkpoint/dcp.py `publish`): the same
order as the synchronous save. The thread's collectives run on a gloo group of their own, so they
never interleave with the training step's. A pending save is finished before the next save starts,
and before export or exit (`wait`); its failure is agreed on by every rank in the thread and raised
there, on every rank, as the synchronous path's one-line CheckpointError.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils._pytree import tree_map

from megatron_rl.errors import CheckpointError
from megatron_rl.files.owned_paths import refuse_symlinks_out
from megatron_rl.rl.checkpoint import checksums
from megatron_rl.rl.checkpoint import dcp as ckpt
from megatron_rl.rl.checkpoint.failures import save_failure
from megatron_rl.rl.checkpoint.state import dcp_state, is_megatron
from megatron_rl.rl.optim.megatron_train import OPTIM_FILE


def host_copy(state):
    """A copy of `state` whose tensors live in host memory and share nothing with the live ones."""
    return tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, state)


class CheckpointWriter:
    """This rank's saves of one run into `out_dir`: `save` as rl/checkpoint/dcp.py `save_checkpoint`, in
    the background when `background`; `keep`: the retention (keep_last, keep_every), None for none.
    `on_saved(seconds)`: a save's full duration, reported once it is written (rl/deadline.py)."""

    def __init__(self, background: bool, out_dir, rank: int, keep: tuple[int, int] | None, on_saved=None):
        self.group = dist.new_group(backend="gloo") if background else None
        self.out_dir, self.rank, self.keep = out_dir, rank, keep
        self.on_saved = on_saved
        self._thread = None
        self._outcome = None  # (error message or None, exception or None, seconds) of the last write

    def save(self, step: int, model, optimizer, ref_model, trainer_state: dict, history, last: bool = False) -> None:
        """`last`: the run's final save (the last step, a stop): waited for before returning."""
        self.wait()
        t0 = time.perf_counter()
        rank, keep = self.rank, self.keep
        if self.group is None:
            ckpt.save_checkpoint(self.out_dir, step, model, optimizer, ref_model, trainer_state, history, rank, keep)
            if self.on_saved is not None:
                self.on_saved(time.perf_counter() - t0)
            return
        path = ckpt.step_dir(self.out_dir, step)
        root = path.parent
        refuse_symlinks_out(root, path, root / "latest")
        state = host_copy(dcp_state(model, optimizer, ref_model))
        optim = host_copy(optimizer.saved_state()) if is_megatron(optimizer) else None
        # Snapshots: the next step changes the trainer state and appends to the history.
        sidecars = (json.loads(json.dumps({"step": step, **trainer_state})), list(history.records))
        staged_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._write, name=f"checkpoint-{step}",
                                        args=(path, state, optim, sidecars, rank, keep, staged_s))
        self._thread.start()
        if last:
            self.wait()

    def wait(self) -> None:
        """Finish the pending save, if any; raise its failure (the same on every rank)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        message, exc, seconds = self._outcome
        if exc is not None:  # a bug or an interrupt in the writer keeps its traceback
            raise exc
        if message is not None:
            raise CheckpointError(message)
        if self.on_saved is not None:
            self.on_saved(seconds)

    def close(self) -> None:
        """After a failure elsewhere: let the pending write end (every rank's thread runs it), raise nothing."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, path: Path, state, optim, sidecars, rank, keep, staged_s) -> None:
        t0 = time.perf_counter()
        try:
            message = None
            try:
                dcp.save(state, checkpoint_id=str(path), process_group=self.group)
                if optim is not None:
                    torch.save(optim, path / OPTIM_FILE.format(rank=rank))
                if rank == 0:  # before the checksums, which cover them
                    ckpt.write_sidecars(path, *sidecars)
                dist.barrier(group=self.group)  # every rank's files are whole before they are hashed
                checksums.write_checksums(path, rank, self.group)
                dist.barrier(group=self.group)
                if keep is not None:
                    checksums.verify_checksums(path, only=[".metadata", *checksums.SIDECARS], group=self.group)
            except (OSError, CheckpointException) as e:
                message = save_failure(path, e)
            except CheckpointError as e:
                message = str(e)
            messages = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(messages, message, group=self.group)
            message = next((m for m in messages if m is not None), None)
            if message is None:  # verified on every rank: only now may `latest` move
                ckpt.publish(path, rank, keep, self.group)
            self._outcome = (message, None, staged_s + time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001  (carried to the main thread by `wait`)
            self._outcome = (None, e, 0.0)
