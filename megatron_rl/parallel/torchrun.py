"""torchrun's environment, read without torch: whether this process is one rank of a torchrun world
(`under_torchrun`, refusing a half-set environment) and whether it speaks for the run
(`driver_process`). The launcher (`launch.py`) joins the world; the run folder's lock
(`files/out_lock.py`), which `flexfloor --help`'s path imports, asks who holds it.
"""
from __future__ import annotations

import os

from elastic.errors import shorten
from megatron_rl.errors import FlexFloorError

# What torchrun (and Slurm scripts that start ranks themselves) set for every rank.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def driver_process() -> bool:
    """True in the process that speaks for the run: the launcher of flexfloor's own ranks, or
    torchrun's world rank 0 (every torchrun rank runs the driver's code; one of them says it)."""
    return os.environ.get("RANK", "0") == "0"


def under_torchrun() -> bool:
    """True when this process is one rank of a torchrun world. Some of its variables without the
    others (left over in a shell, half exported by a script) would join a world nobody else joins,
    and wait out the timeout: refused at once, saying what is missing."""
    have = [v for v in TORCHRUN_VARS if os.environ.get(v)]
    if not have:
        return False
    missing = [v for v in TORCHRUN_VARS if v not in have]
    unset = "unset " + " ".join(have)
    if missing:
        raise FlexFloorError(f"torchrun environment half set: {', '.join(have)} set but {', '.join(missing)} "
                             f"not; under torchrun all of {', '.join(TORCHRUN_VARS)} are set, outside it "
                             f"none is (`{unset}`)")
    try:
        rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        port = int(os.environ["MASTER_PORT"])
    except ValueError:
        got = ", ".join(f"{v}={shorten(repr(os.environ[v]), 20)}" for v in TORCHRUN_VARS)
        raise FlexFloorError(f"torchrun environment: expected integers in RANK, WORLD_SIZE, LOCAL_RANK and "
                             f"MASTER_PORT, got {got}") from None
    if not (0 <= rank < world and 0 <= local <= rank and 0 < port < 65536):
        raise FlexFloorError(f"torchrun environment: expected 0 <= LOCAL_RANK <= RANK < WORLD_SIZE and a "
                             f"port, got RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local} MASTER_PORT={port}")
    return True
