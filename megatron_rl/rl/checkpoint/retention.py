"""Checkpoints that fit the disk: which to keep, removing the rest safely, and what a save costs.

A 30B-A3B save is about 430 GB (14 bytes a parameter); keeping every one of 50 saves is 21 TB. So:
  - kept: the `keep_last` newest checkpoints up to `latest`, every `keep_every`-th step (0: none),
    and `latest` itself; a step above `latest` (left by `--resume-step`, replaced as the run passes
    it again) is left alone;
  - removed only after the newer checkpoint's listing is verified and `latest` names it
    (rl/checkpoint/dcp.py save_checkpoint calls `prune` then), so `latest` never names a removed one;
  - a folder is first renamed to `.deleting-step_<N>` (atomic) and then removed: a crash during
    the removal leaves a hidden folder that nothing reads and the next `prune` finishes;
  - only real `step_<N>` folders directly in `checkpoints/` are FlexFloor's to remove (a symlink
    is the user's and stays).
`check_room` prints the size of a save and the free space at start, and refuses a run whose
first save would not fit.
"""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import torch

from megatron_rl.errors import CheckpointError
from megatron_rl.models.qwen3_moe import DTYPES, Qwen3MoeModel

_STEP = re.compile(r"step_(\d{6,})")
DELETING = ".deleting-"


def kept_steps(steps: list[int], latest: int, keep_last: int, keep_every: int) -> set[int]:
    """Which of `steps` stay when `latest` is the newest checkpoint."""
    upto = sorted(s for s in steps if s <= latest)
    keep = set(upto[-keep_last:]) | {latest} | {s for s in steps if s > latest}
    if keep_every:
        keep |= {s for s in upto if s % keep_every == 0}
    return keep


def prune(root: Path, latest: Path, keep_last: int, keep_every: int) -> list[Path]:
    """Remove the checkpoints in `root` that `kept_steps` does not keep; returns what was removed."""
    for leftover in root.glob(f"{DELETING}step_*"):  # of a removal a crash interrupted
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
    folders = {int(m.group(1)): p for p in root.iterdir()
               if (m := _STEP.fullmatch(p.name)) and p.is_dir() and not p.is_symlink()}
    keep = kept_steps(list(folders), int(_STEP.fullmatch(latest.name).group(1)), keep_last, keep_every)
    removed = []
    for step in sorted(set(folders) - keep):
        doomed = root / f"{DELETING}{folders[step].name}"
        folders[step].rename(doomed)  # from here on nothing reads it
        shutil.rmtree(doomed)
        removed.append(folders[step])
    return removed


def save_bytes(cfg) -> int:
    """About how many bytes one checkpoint of run config `cfg` takes: the weights, the optimizer's
    state (fp32 masters and two fp32 moments under bf16/fp16, else two moments in the weights'
    dtype) and the frozen reference model when a KL term is used."""
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen3MoeModel(cfg.model).parameters())
    w = DTYPES[cfg.dtype].itemsize
    per_param = w + (12 if w < 4 else 2 * w) + (w if cfg.grpo.kl_coef > 0 else 0)
    return n * per_param


def check_room(cfg, out_dir: str | Path) -> None:
    """Print a save's size, what retention keeps and the free space; refuse if one save cannot fit."""
    root = Path(out_dir) / "checkpoints"
    where = next(p for p in (root, *root.parents) if p.exists())
    free, need = shutil.disk_usage(where).free, save_bytes(cfg)
    ck = cfg.checkpoint
    kept = f"keep_last {ck.keep_last}" + (f" and every {ck.keep_every}th step" if ck.keep_every else "")
    gb = 1e9
    print(f"[train] checkpoints: about {need / gb:.3g} GB a save, {kept}: about {need * (ck.keep_last + 1) / gb:.3g} "
          f"GB at most while a save is written{' (plus the kept every-Nth ones)' if ck.keep_every else ''}; "
          f"{free / gb:.3g} GB free in {where}", file=sys.stderr)
    if need > free:
        raise CheckpointError(f"{root}: a checkpoint takes about {need / gb:.3g} GB and {where} has "
                              f"{free / gb:.3g} GB free; free space, or choose another --out")
