"""A command's parallel layout (`elastic.planning.dims.ParallelDims`) from its config and this host.

`rollout`, `train` and the rollout phase build it here, once, and ask it for the ranks, the EP
group, the stage sizes their backend allows and the ranks per node; a layout no rank can run is a
`ConfigError` (one line at the CLI).
"""
from __future__ import annotations

import os

from elastic.planning.dims import LayoutError, ParallelDims
from elastic.planning.plan import BACKEND_OWNERSHIP
from megatron_rl.errors import ConfigError


def ranks_on_this_host(ranks: int) -> int:
    """Ranks that share this host's memory: torchrun's LOCAL_WORLD_SIZE, else all of them (the
    `flexfloor` launcher starts every rank here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", ranks))


def parallel_dims(ranks: int, experts: int, backend: str = "torch",
                  source: str = "model.num_moe_experts") -> ParallelDims:
    """The layout of `ranks` ranks over a model of `experts` experts on `backend`; `source` names
    where the expert count came from in an error."""
    try:
        return ParallelDims(ranks, experts, BACKEND_OWNERSHIP[backend], ranks_on_this_host(ranks), source)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
