"""The MoE backend of a run, picked once from its config and asked everywhere below.

A config's `backend` names one (`BACKENDS`); `backend(name)` gives its object, which the config
hands down as `cfg.moe_backend` (as megatron-core picks its dispatcher class once, and vLLM its
executor): code below asks it instead of comparing the name. A `Backend` holds what differs
between the plain-PyTorch MoE (`torch.py`) and megatron-core's (`megatron.py`): the dtypes it runs,
what it needs of the machine, the training model and optimizer, the elastic engine, and how the
trainer keeps its expert modules across a rollout.

This module imports neither torch nor megatron-core (each backend imports them inside its methods):
config validation and the pure-Python planner side use it.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod

from megatron_rl.config import require
from megatron_rl.errors import ConfigError

BACKENDS = ("torch", "megatron")


class Backend(ABC):
    """One MoE backend. The defaults are what both backends share."""

    name: str = ""
    # The dtypes (`models.qwen3_moe.DTYPES` names) it runs; None: every one the model runs.
    dtypes: tuple[str, ...] | None = None

    def require_dtype(self, dtype: str) -> None:
        """The one home of "backend B runs only these dtypes" (configs, preflight, the optimizer)."""
        if self.dtypes is not None:
            require(dtype in self.dtypes,
                    f"backend {self.name}: dtype must be {' or '.join(self.dtypes)}, got {dtype}")

    def require_training(self, cfg) -> None:
        """What `train` with this backend cannot do, refused at config load (`TrainerConfig`)."""
        self.require_dtype(cfg.dtype)

    def preflight(self, dtype: str) -> None:
        """The backend's libraries and device, then a dtype it runs (`rollout/preflight.py`)."""
        self.require_dtype(dtype)

    def describe(self) -> dict:
        """What hosts the MoE layers, for the training run's W&B config."""
        return {"backend": self.name}

    def rollout_report(self, dtype, device) -> dict:
        """What hosts the MoE layers and how, for the rollout report (`dtype`, `device`: torch's)."""
        return self.describe()

    def build_model(self, mcfg, experts: list[int], dtype: str, checkpoint: str | None, seed: int,
                    device=None):
        """This rank's model holding `experts`, in the plain-PyTorch MoE layers on both backends
        (megatron's replace them later: `for_training`, or the elastic engine's first group): the
        HuggingFace `checkpoint`'s weights, or fresh ones from `seed`; on `device` when given."""
        from megatron_rl.models.qwen3_moe import DTYPES

        if checkpoint is not None:
            from megatron_rl.models.hf import load_hf_checkpoint

            model = load_hf_checkpoint(checkpoint, DTYPES[dtype], experts=experts)
        else:
            from megatron_rl.models.qwen3_moe import Qwen3MoeModel

            model = Qwen3MoeModel(mcfg, experts, DTYPES[dtype])
            model.init_weights(seed)
        if device is not None:
            model.to(device)
        return model

    @abstractmethod
    def for_training(self, model, rank: int, world: int) -> None:
        """Turn the built model into the one this backend trains."""

    @abstractmethod
    def optimizer(self, model, cfg, rank: int, world: int):
        """The optimizer of `train` (`cfg`: a TrainerConfig) for this rank's `model`."""

    @abstractmethod
    def elastic_engine(self, spec, engine, carried: dict | None = None):
        """(the engine `elastic/` drives over `engine` for `spec`, a `RankRollout`; the online
        driver, or None) (`rollout/rank_rollout.py`)."""

    @abstractmethod
    def check_plan(self, plan) -> None:
        """Refuse, before any rank starts, a plan this backend's layers cannot carry out."""

    @abstractmethod
    def keep_experts(self, model):
        """The trainer's expert modules before a rollout, for `restore_experts` after it."""

    @abstractmethod
    def restore_experts(self, model, kept) -> None:
        """Put the modules `keep_experts` kept back, holding the weights the rollout restored: the
        optimizer keeps training the same parameter objects."""


@functools.cache
def backend(name: str) -> Backend:
    """The backend called `name` (one of `BACKENDS`), built once per process."""
    from megatron_rl.backends.megatron import MegatronBackend
    from megatron_rl.backends.torch import TorchBackend

    for kind in (TorchBackend, MegatronBackend):
        if kind.name == name:
            return kind()
    raise ConfigError(f"backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
