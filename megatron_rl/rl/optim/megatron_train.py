"""Training with `backend: megatron`: megatron-core's DDP and DistributedOptimizer around the model
whose MoE layers are megatron-core's (`megatron_backend.MegatronMoE`).

- Gradients flow through megatron-core's router, token dispatcher and experts in backward, into
  DDP's contiguous fp32 gradient buffers (`grad_reduce_in_fp32`), reduced in buckets as backward
  produces them (`overlap_grad_reduce`). Dense gradients are summed over the world (the loss is
  already divided by the global token count, so `calculate_per_token_loss` turns off DDP's 1/DP
  averaging); expert gradients stay with their owner (megatron-core marks expert parameters
  `allreduce=False`, and their expert-data-parallel group is the rank alone).
- The DistributedOptimizer keeps fp32 master weights and fp32 Adam state, sharded over the world
  for the dense part; clips by the global norm (`clip_grad`) over dense and every rank's experts;
  writes the updated weights back into the bf16 (or fp32) model parameters the rollout uses.

megatron-core's gradient buffers, communication streams and DistributedOptimizer allocate CUDA
tensors, so `MegatronOptimizer` is built on GPUs only in the product. Tests run it, its GRPO steps
and its checkpoint save and resume on CPU gloo ranks through the test harness
(tests/megatron_harness.py; tests/distributed/test_megatron_harness.py); tools/gpu_check.sh's
megatron rows run it on a GPU. megatron-core itself is imported inside the builders, as in
models/megatron_backend.py: it takes seconds to import and warns without TransformerEngine and apex,
and a torch-backend run that imports this module (`training_state_bytes`) never builds one.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.errors import CheckpointError, FlexFloorError
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.megatron_backend import megatron_device, moe_pg_collection, self_group, transformer_config


def optimizer_config(optim, dtype: torch.dtype):
    """megatron-core's OptimizerConfig for `optim` (a `trainer_config.OptimConfig`, not imported: the
    trainer's config sits above this module, whose backend builds the optimizer here): Adam(W) with
    fp32 masters and fp32 state."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
        clip_grad=optim.grad_clip, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        main_grads_dtype=torch.float32, main_params_dtype=torch.float32,
        exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
        use_distributed_optimizer=True,
    )


def ddp_config():
    """Bucketed fp32 gradient reduction, overlapped with backward, for the DistributedOptimizer."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                         use_distributed_optimizer=True, check_for_nan_in_grad=True)


def training_config(mcfg: MoEModelConfig, ep_size: int, dtype: torch.dtype):
    """The model's TransformerConfig for DDP: losses are already per global token (sum, not mean)."""
    return replace(transformer_config(mcfg, ep_size=ep_size, dtype=dtype, device="cuda"),
                   calculate_per_token_loss=True)


def training_groups(rank: int, world: int):
    """The ProcessGroupCollection of training: data parallel and expert parallel over the world,
    every model-parallel dimension (tensor, pipeline, context, expert tensor) and expert data
    parallelism the rank alone, one DistributedOptimizer instance over the world."""
    world_group = dist.group.WORLD
    pgc = moe_pg_collection(world_group, self_group(rank, world), world_group)
    alone = pgc.tp
    pgc.mp = pgc.embd = pgc.pos_embd = pgc.intra_expt_dp = alone
    pgc.tp_ep_pp = pgc.dp_cp = pgc.intra_dp_cp = pgc.intra_dist_opt = world_group
    return pgc


OPTIM_FILE = "megatron_optim.rank{rank}.pt"  # rl/checkpoint/checksums.py covers these files


class MegatronOptimizer:
    """megatron-core's DDP + DistributedOptimizer over `model`, for `PolicyUpdate` and the trainer:
    `zero_grad()`, backward as usual, then `finish_step()` -> the global gradient norm.

    Run on CPU gloo ranks through the test harness (tests/megatron_harness.py); on GPUs by
    tools/gpu_check.sh's megatron rows."""

    def __init__(self, model, mcfg: MoEModelConfig, optim, dtype: torch.dtype, pgc):
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import get_megatron_optimizer

        if megatron_device() == "cuda" and not torch.cuda.is_available():
            raise FlexFloorError("backend 'megatron' trains with megatron-core's DistributedOptimizer, "
                                 "whose buffers are CUDA tensors; this machine has no CUDA device")
        config = training_config(mcfg, pgc.ep.size(), dtype)
        self.ddp = DistributedDataParallel(config, ddp_config(), model, pg_collection=pgc)
        self.optimizer = get_megatron_optimizer(optimizer_config(optim, dtype), [self.ddp],
                                                use_gloo_process_groups=False, pg_collection=pgc)

    @property
    def param_groups(self) -> list[dict]:
        """The inner torch optimizers' groups (lr, betas, ...), as the trainer reads a torch
        optimizer's; megatron-core's optimizer classes do not expose them."""
        return [g for opt in self._inner() for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none)

    def finish_step(self) -> float:
        """Wait for the bucketed gradient reduction, step (clipping by the global norm), and
        return the norm before clipping."""
        self.ddp.finish_grad_sync()
        ok, grad_norm, _zeros = self.optimizer.step()
        if not ok:
            raise FloatingPointError("megatron-core's optimizer skipped the step (inf/nan gradients)")
        return float(grad_norm)

    def _inner(self) -> list:
        """The torch optimizers megatron-core steps (one per DistributedOptimizer instance: dense,
        expert-parallel), over this rank's fp32 shards."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [opt.optimizer for opt in chained]

    # Checkpoints: this rank's shard of the optimizer beside the DCP model shards, as tensors and
    # plain values only (loaded with weights_only=True; rl/checkpoint/checksums.py hashes the file). Not
    # megatron-core's `save_parameter_state`: it gathers over gloo groups, which megatron-core does
    # not create when process groups are passed. A resume needs the same rank count.
    def save(self, path: Path, rank: int) -> None:
        torch.save(self.saved_state(), path / OPTIM_FILE.format(rank=rank))

    def saved_state(self) -> dict:
        """What `save` writes (rl/checkpoint/async_save.py copies it to the host and writes it in the background)."""
        return {str(i): {"optimizer": opt.state_dict(),
                         "masters": [p.detach() for g in opt.param_groups for p in g["params"]]}
                for i, opt in enumerate(self._inner())}

    def load(self, path: Path, rank: int) -> None:
        file = path / OPTIM_FILE.format(rank=rank)
        try:
            state = torch.load(file, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001  (a torn or foreign file raises whatever it hits)
            raise CheckpointError(f"{file}: unreadable optimizer shard ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
        inner = self._inner()
        if sorted(state) != [str(i) for i in range(len(inner))]:
            raise CheckpointError(f"{file}: {len(state)} optimizer shards, this run has {len(inner)} "
                                  "(resume with the rank count the checkpoint was written with)")
        for i, opt in enumerate(inner):
            mine = [p for g in opt.param_groups for p in g["params"]]
            saved = state[str(i)]["masters"]
            if [p.shape for p in mine] != [p.shape for p in saved]:
                raise CheckpointError(f"{file}: the optimizer's shards have other shapes than this run's "
                                      "(resume with the rank count the checkpoint was written with)")
            with torch.no_grad():  # the fp32 masters are leaf tensors the optimizer steps on
                for p, q in zip(mine, saved):
                    p.copy_(q)
            opt.load_state_dict(state[str(i)]["optimizer"])
