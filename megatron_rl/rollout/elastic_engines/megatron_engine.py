"""The rollout engine with the `megatron` MoE backend, seen through `elastic.runtime.interface.ElasticEngine`.

megatron-core's MoELayer cannot gain or lose one expert: its experts are fixed at construction as
the EP rank's contiguous block. So expert moves are collected (`import_expert` keeps the weights,
`drop_expert` forgets them) and `use_group` rebuilds every MoE layer over the new group with them
(`megatron_backend.rebuild_ep`), in the order the elastic runtime calls them: moves, drops, switch.
The first `use_group` turns the torch-backend layers the model was built with into megatron ones.
Stage owners must be megatron's blocks (`elastic.planning.dims.block_owners` of the stage's members).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from elastic.planning.dims import LayoutError, block_owners
from elastic.planning.plan import Plan
from megatron_rl.errors import FlexFloorError
from megatron_rl.models.megatron_backend import (
    ExpertWeights,
    MegatronMoE,
    install_megatron_moe,
    megatron_options,
    moe_pg_collection,
    rebuild_ep,
    require_cuda_model,
    self_group,
)
from megatron_rl.models.params import is_expert_param, tensor_digest
from megatron_rl.rollout.elastic_engines.torch_engine import ElasticRolloutEngine
from megatron_rl.rollout.engine import RolloutEngine


def check_plan(plan: Plan) -> None:
    """Refuse, before any rank starts, a plan whose stages megatron-core's layers cannot hold."""
    if plan.ownership != "blocks":
        raise FlexFloorError(
            f"backend 'megatron': expected a plan owning experts in megatron-core's contiguous blocks, got "
            f"{plan.ownership!r}; plan it with the megatron backend's layout (megatron_rl.parallel.dims."
            "parallel_dims) or use `backend: torch`")
    try:
        plan.check()
    except ValueError as e:
        raise FlexFloorError(f"backend 'megatron': {e}") from None


class MegatronElasticEngine(ElasticRolloutEngine):
    """`self_group` is the group of this rank alone; `options` go to MegatronMoE."""

    def __init__(self, engine: RolloutEngine, world: int, self_group, **options):
        super().__init__(engine, world)
        self.self_group, self.options = self_group, options
        self.incoming: dict[int, list[ExpertWeights]] = {}
        self.dropped: set[int] = set()

    def _built(self) -> bool:
        return isinstance(self.model.moe_layers[0], MegatronMoE)

    def held_experts(self) -> list[int]:
        built = self.model.moe_layers[0].local_experts if self._built() else super().held_experts()
        return sorted((set(built) | set(self.incoming)) - self.dropped)

    def expert_layers(self, expert: int) -> list[ExpertWeights]:
        if expert in self.incoming:
            return self.incoming[expert]
        if not self._built():
            return super().expert_layers(expert)
        return [moe.expert_weights()[expert] for moe in self.model.moe_layers]

    def import_expert(self, expert: int, flat: torch.Tensor) -> None:
        self.incoming[expert] = self.split_expert(flat)
        self.dropped.discard(expert)

    def drop_expert(self, expert: int) -> None:
        self.incoming.pop(expert, None)
        self.dropped.add(expert)

    def use_group(self, group, owners: dict[int, int]) -> None:
        members = dist.get_process_group_ranks(group)
        try:
            blocks = {e: rs[0] for e, rs in block_owners(len(owners), members).items()}
        except LayoutError as e:
            raise FlexFloorError(f"backend 'megatron': a stage on ranks {members}: {e}; plan a floor that divides "
                                 "them") from None
        if owners != blocks:
            raise FlexFloorError(
                f"backend 'megatron': a stage on ranks {members}: expected experts in megatron-core's contiguous "
                "blocks, got other owners; plan it with elastic.planning.dims.block_owners or use `backend: torch`")
        if self._built() and self.model.moe_layers[0].layer.ep_group is group and not (self.incoming or self.dropped):
            return  # already over this group with these experts (training built them over the world)
        pgc = moe_pg_collection(group, self.self_group)
        if self._built():
            rebuild_ep(self.model, pgc, self.incoming, self.dropped)
        else:
            if self.incoming or self.dropped:
                raise RuntimeError("expert moves before the megatron layers were first built")
            install_megatron_moe(self.model, pgc, **self.options)
        self.incoming, self.dropped = {}, set()

    @classmethod
    def on_gpu(cls, engine: RolloutEngine, rank: int, world: int) -> "MegatronElasticEngine":
        """The engine `flexfloor rollout` and the trainer run: megatron-core's layers on this rank's
        GPU (`megatron_options`). Run through the CLI on CPU ranks by the test harness
        (tests/e2e/test_megatron_cli_harness.py); on a GPU by tools/gpu_check.sh's megatron rows."""
        require_cuda_model(engine.model)
        return cls(engine, world, self_group(rank, world), **megatron_options(engine.model.dtype))

    def checksums(self) -> dict[str, str]:
        # The runtime compares these before the first `use_group` (torch layers) and after the
        # restore (megatron layers): name the router as the torch backend does, and the experts,
        # which sit under block-local names in megatron's layers, by their global index.
        out = {name.replace(".mlp.layer.", ".mlp."): tensor_digest(p) for name, p in self.model.named_parameters()
               if not is_expert_param(name)}
        for e in self.held_experts():
            out[f"expert.{e}"] = tensor_digest(self.export_expert(e))
        return out
