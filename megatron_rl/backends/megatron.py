"""The `megatron` MoE backend: megatron-core's MoELayer (`models/megatron_backend.py`), trained
with its DDP and DistributedOptimizer (`rl/optim/megatron_train.py`), rolled out by the engine that
rebuilds its layers over each stage's group (`rollout/elastic_engines/megatron_engine.py`). GPUs only, in
bfloat16 or float32; experts in megatron-core's contiguous blocks; no online rule."""
from __future__ import annotations

import torch

from megatron_rl.backends.base import Backend
from megatron_rl.models.megatron_backend import (
    backend_report,
    install_megatron_moe,
    megatron_options,
    require_cuda_model,
)
from megatron_rl.models.qwen3_moe import DTYPES
from megatron_rl.rl.optim.megatron_train import MegatronOptimizer, training_groups
from megatron_rl.rollout.elastic_engines.megatron_engine import MegatronElasticEngine, check_plan


class MegatronBackend(Backend):
    name = "megatron"

    def describe(self) -> dict:
        return backend_report()

    def for_training(self, model, rank: int, world: int) -> None:
        """megatron-core's layers over the world, on the model's CUDA device."""
        require_cuda_model(model)
        install_megatron_moe(model, training_groups(rank, world), **megatron_options(model.dtype))

    def optimizer(self, model, cfg, rank: int, world: int):
        self.rules.require_dtype(cfg.dtype)  # megatron-core's optimizer keeps bf16 or fp32 parameters only
        return MegatronOptimizer(model, cfg.model, cfg.optim, DTYPES[cfg.dtype], training_groups(rank, world))

    def elastic_engine(self, spec, engine, carried: dict | None = None):
        """megatron-core's layers on this rank's GPU, rebuilt over each stage's group; NCCL only (no
        host staging), no online rule: its experts stay in contiguous blocks."""
        return MegatronElasticEngine.on_gpu(engine, spec.rank, spec.world), None

    def check_plan(self, plan) -> None:
        check_plan(plan)

    def keep_experts(self, model) -> list:
        # A shrink rebuilds megatron-core's layers; the optimizer holds the originals' parameters.
        return [layer.mlp for layer in model.decoder.layers]

    def restore_experts(self, model, kept: list) -> None:
        """The pre-rollout MegatronMoE blocks back (the runtime has checked the restored weights'
        checksums against the pre-rollout ones)."""
        for layer, before in zip(model.decoder.layers, kept):
            now = layer.mlp
            if now is before:
                continue
            assert now.local_experts == before.local_experts, "restore left a different block of experts"
            with torch.no_grad():
                before.router_weight.copy_(now.router_weight)
                old = before.expert_weights()  # one walk of the layer's experts, not one per expert
                for e, (fc1, fc2) in now.expert_weights().items():
                    old1, old2 = old[e]
                    old1.copy_(fc1)
                    old2.copy_(fc2)
            layer.mlp = before
