"""What a config may ask of its MoE backend, decided at config load: the names (`BACKENDS`), the
dtypes each runs, what `train` with it cannot do, and what the machine must offer.

A config holds the backend's name and asks `backend_rules(name)`; the `Backend` objects that build
models, optimizers and elastic engines (`megatron_rl/backends/`) stand above rollout/ and rl/, are
built once by the command or its rank entry and passed down, and ask these rules too (one home per
rule). This module imports neither torch nor megatron-core (the preflight imports them inside):
config validation and the pure-Python planner side use it.
"""
from __future__ import annotations

import functools

from megatron_rl.config import require
from megatron_rl.errors import ConfigError

BACKENDS = ("torch", "megatron")


class BackendRules:
    """One backend's rules; the defaults are what both backends share."""

    name: str = ""
    # The dtypes (`models.qwen3_moe.DTYPES` names) it runs; None: every one the model runs.
    dtypes: tuple[str, ...] | None = None
    # Copies of each held expert's weights its MoE block keeps beside them, which the rollout's KV
    # budget and the training table price (`MemoryBudget.expert_copies`); none by default.
    expert_copies: int = 0

    def require_dtype(self, dtype: str) -> None:
        """The one home of "backend B runs only these dtypes" (configs, preflight, the optimizer)."""
        if self.dtypes is not None:
            require(dtype in self.dtypes,
                    f"backend {self.name}: expected dtype {' or '.join(self.dtypes)}, got {dtype}")

    def require_training(self, cfg) -> None:
        """What `train` with this backend cannot do, refused at config load (`TrainerConfig`)."""
        self.require_dtype(cfg.dtype)

    def preflight(self, dtype: str) -> None:
        """The backend's libraries and device, then a dtype it runs (`megatron_rl/preflight.py`)."""
        self.require_dtype(dtype)


class TorchRules(BackendRules):
    """The plain-PyTorch MoE block: CPU or GPU, every dtype the model runs."""

    name = "torch"
    # `ExpertBank.stacked` (models/moe.py): the grouped GEMM's stacked copy of the held experts,
    # built at a bank's first forward on any device and kept (the per-expert loop reads its grouping).
    expert_copies = 1


class MegatronRules(BackendRules):
    """megatron-core's MoELayer, DDP and DistributedOptimizer: GPUs only, bfloat16 or float32."""

    name = "megatron"
    dtypes = ("bfloat16", "float32")  # what megatron-core's layers and optimizer run

    def require_training(self, cfg) -> None:
        super().require_training(cfg)
        require(cfg.grpo.kl_coef == 0, f"backend megatron: expected grpo.kl_coef 0 (a frozen reference model "
                                       f"is not supported yet) or backend torch, got {cfg.grpo.kl_coef:g}")
        require(cfg.optim.offload == "none", "backend megatron: expected optim.offload none (megatron-core's "
                                             "DistributedOptimizer keeps its own state) or backend torch, "
                                             f"got {cfg.optim.offload}")

    def preflight(self, dtype: str) -> None:
        # Deferred: megatron_backend imports torch, which config validation does not (module docstring).
        # Through the module: tests stand in for the CUDA check (`megatron_backend.require_backend`).
        from megatron_rl.models import megatron_backend

        megatron_backend.require_backend()
        super().preflight(dtype)


@functools.cache
def backend_rules(name: str) -> BackendRules:
    """The rules of the backend called `name` (one of `BACKENDS`)."""
    for kind in (TorchRules, MegatronRules):
        if kind.name == name:
            return kind()
    raise ConfigError(f"backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
