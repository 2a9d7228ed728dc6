"""What every MoE backend is (`Backend`): the model it trains, its optimizer, its elastic engine and
how the trainer keeps its expert modules across a rollout; the defaults are what both backends share.
`torch.py` and `megatron.py` are the two; `backend(name)` (`__init__.py`) gives one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch.distributed as dist

from elastic.planning.dims import block_owners
from megatron_rl.backend_rules import BackendRules, backend_rules
from megatron_rl.models.ep_dispatch import AllToAllDispatcher
from megatron_rl.models.hf import load_hf_checkpoint
from megatron_rl.models.moe import LocalDispatcher
from megatron_rl.models.qwen3_moe import DTYPES, Qwen3MoeModel


class Backend(ABC):
    """One MoE backend. The defaults are what both backends share."""

    name: str = ""

    @property
    def rules(self) -> BackendRules:
        """What its config checked (`backend_rules`): the dtypes it runs, what training refuses."""
        return backend_rules(self.name)

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
        if checkpoint is not None:
            model = load_hf_checkpoint(checkpoint, DTYPES[dtype], experts=experts)
        else:
            model = Qwen3MoeModel(mcfg, experts, DTYPES[dtype])
            model.init_weights(seed)
        if device is not None:
            model.to(device)
        return model

    def training_model(self, cfg, rank: int, world: int, device=None):
        """This rank's model on `device` as this backend trains it (`cfg`: a TrainerConfig): dense
        weights and the experts megatron-core's contiguous blocks give it, its EP dispatcher, then
        `for_training`. On the device before the megatron layers are installed, which need CUDA."""
        owners = block_owners(cfg.model.num_moe_experts, range(world))
        held = [e for e, rs in owners.items() if rank in rs]
        model = self.build_model(cfg.model, held, cfg.dtype, cfg.init, cfg.seed, device)
        model.recompute_activations = cfg.recompute_activations
        model.set_dispatcher(LocalDispatcher() if world == 1 else
                             AllToAllDispatcher(dist.group.WORLD, [owners[e][0] for e in sorted(owners)]))
        self.for_training(model, rank, world)
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
