"""A command's parallel layout (`elastic.planning.dims.ParallelDims`) from its config and this host.

`rollout`, `train`, `plan`, `simulate` and the rollout phase build it here, once, and ask it for
the ranks, the EP group, the stage sizes their backend allows and the ranks per node. Which expert
ownership a backend needs is decided here only, and so whether a policy can run on it; a layout no
rank can run is a `ConfigError` (one line at the CLI).
"""
from __future__ import annotations

import os

from elastic.planning.dims import LayoutError, ParallelDims, check_floor
from elastic.planning.policies import PolicyError, policy_kind
from megatron_rl.errors import ConfigError

# The expert ownership each MoE backend carries out: ours places any expert on any rank;
# megatron-core's MoELayer holds one contiguous block per EP rank.
_OWNERSHIP = {"torch": "balanced", "megatron": "blocks"}


def ranks_on_this_host(ranks: int) -> int:
    """Ranks that share this host's memory: torchrun's LOCAL_WORLD_SIZE, else all of them (the
    `flexfloor` launcher starts every rank here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", ranks))


def parallel_dims(ranks: int, experts: int, backend: str = "torch",
                  source: str = "model.num_moe_experts", even: bool = True) -> ParallelDims:
    """The layout of `ranks` ranks over a model of `experts` experts on `backend`; `source` names
    where the expert count came from in an error; `even=False` for a world only planned or
    simulated (`ParallelDims.even`)."""
    try:
        return ParallelDims(ranks, experts, _OWNERSHIP[backend], ranks_on_this_host(ranks), source, even)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def require_floor(floor: int, ranks: int, name: str = "floor") -> None:
    """A config's floor within 1..ranks (`elastic.planning.dims.check_floor`), as a ConfigError."""
    try:
        check_floor(floor, ranks, name)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def require_policy(policy: str, backend: str, name: str = "policy") -> None:
    """A config's policy runs under its backend's expert ownership (`adaptive` needs the torch
    backend's), checked at config load, before any rank starts."""
    try:
        policy_kind(policy).check_ownership(_OWNERSHIP[backend])
    except PolicyError as e:
        raise ConfigError(f"{name} {policy}: {e}") from None
