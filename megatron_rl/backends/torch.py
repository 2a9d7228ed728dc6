"""The `torch` MoE backend: the plain-PyTorch MoE block (`models/moe.py`), on CPU or GPU, in every
dtype the model runs; the only one whose rollout migrates requests under the `adaptive` online rule."""
from __future__ import annotations

import torch

from elastic.runtime.online import OnlineDriver
from elastic.runtime.transport import make_transport
from megatron_rl.backends.base import Backend
from megatron_rl.models.moe import expert_report
from megatron_rl.rl.update.train_step import training_optimizer
from megatron_rl.rollout.elastic_engines.torch_engine import ElasticRolloutEngine, MigratingRolloutEngine


class TorchBackend(Backend):
    name = "torch"

    def rollout_report(self, dtype, device) -> dict:
        return self.describe() | expert_report(dtype, device)

    def for_training(self, model, rank: int, world: int) -> None:
        """Nothing: it trains the plain-PyTorch layers it built."""

    def check_plan(self, plan) -> None:
        """Nothing: any plan suits it; its experts move one at a time, to any owner."""

    def optimizer(self, model, cfg, rank: int, world: int):
        """ZeRO-1 and/or host offload, or the replicated optimizer (`train_step.training_optimizer`)."""
        return training_optimizer(model, cfg.optim, rank, world)

    def elastic_engine(self, spec, engine, carried: dict | None = None):
        """The migrating engine with the online driver when a rule re-plans, else the plain one."""
        if spec.rule is None:
            return ElasticRolloutEngine(engine, spec.world, make_transport(spec.transport)), None
        elastic = MigratingRolloutEngine(engine, spec.world, make_transport(spec.transport), carried=carried)
        keys = [(a.prompt_id, a.sample) for a in spec.plan.assignments]
        return elastic, OnlineDriver(spec.rule, keys, [a.rank for a in spec.plan.assignments], spec.rank,
                                     spec.token_scale)

    def keep_experts(self, model) -> list[dict]:
        return [{e: moe.experts.get(e) for e in moe.experts.held()} for moe in model.moe_layers]

    def restore_experts(self, model, kept: list[dict]) -> None:
        for moe, before in zip(model.moe_layers, kept):
            assert moe.experts.held() == sorted(before), "restore left a different set of experts"
            for e, module in before.items():
                now = moe.experts.get(e)
                if now is not module:
                    with torch.no_grad():
                        for p_old, p_new in zip(module.parameters(), now.parameters()):
                            p_old.copy_(p_new)
                    moe.experts.local_experts[str(e)] = module
