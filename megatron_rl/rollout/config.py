"""`flexfloor rollout` / `flexfloor demo` configuration. The defaults are the tiny CPU example
(`examples/tiny_cpu.yaml` spells the same values out): a 2-layer, 8-expert Qwen3-MoE in float64 on 4
gloo ranks, replaying a DeepScaleR-like length-tailed batch scaled down for CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from elastic.planning.policies import POLICIES
from megatron_rl.backend_rules import BACKENDS
from megatron_rl.config import require, require_seed, require_size, require_timeout
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.parallel.device import DeviceChoice, TransportChoice
from megatron_rl.parallel.dims import parallel_dims, require_floor, require_policy
from megatron_rl.partial_config import PartialConfig
from megatron_rl.rollout.kv.kind import KV_CACHES, kv_kind
from megatron_rl.rollout.leases.jobs import LeaseConfig
from megatron_rl.rollout.sampling import SamplingParams


@dataclass
class BatchConfig:
    """Where the batch comes from: a length trace (`trace`), or a synthetic one (`preset`)."""

    trace: str | None = None
    epoch: int | None = None  # default: the trace's last epoch
    preset: str = "deepscaler"
    prompts: int = 16
    samples: int = 4
    epochs: int = 3
    length_scale: float = 0.02
    max_prompt_len: int = 16

    def __post_init__(self):
        require(self.prompts > 0 and self.samples > 0,
                f"batch.prompts/samples: expected > 0, got {self.prompts}/{self.samples}")
        require(self.epochs >= 2, f"batch.epochs: expected >= 2 (the planner needs history), got {self.epochs}")
        require(0 < self.length_scale <= 1, f"batch.length_scale: expected in (0, 1], got {self.length_scale}")
        require(self.max_prompt_len > 0, f"batch.max_prompt_len: expected > 0, got {self.max_prompt_len}")
        require_size(self.prompts * self.samples * self.epochs, "batch.prompts x samples x epochs")
        require_size(self.max_prompt_len, "batch.max_prompt_len")


@dataclass
class RolloutConfig:
    model: MoEModelConfig = field(default_factory=MoEModelConfig)
    checkpoint: str | None = None  # a HuggingFace Qwen3-MoE directory; else random init from `seed`
    # MoE implementation: `torch` (plain PyTorch, CPU or GPU) or `megatron` (megatron-core's
    # MoELayer with TransformerEngine kernels; GPUs only, see megatron_rl/models/megatron_backend.py).
    backend: Literal[BACKENDS] = "torch"
    seed: int = 0
    dtype: Literal["float32", "float64", "bfloat16"] = "float64"
    ranks: int = 4
    max_batch_per_rank: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    batch: BatchConfig = field(default_factory=BatchConfig)
    policy: Literal[POLICIES] = "vanilla"
    floor: int | None = None
    tailguard: bool = False
    status_interval: int = 1
    timeout_s: float = 300.0
    # Side work for detached ranks (elastic policies): `leases.jobs` "rewards" and one of "sidecar"
    # / "sglang"; none by default. Earlier files' flat fields are read too (`upgrade`).
    leases: LeaseConfig = field(default_factory=lambda: LeaseConfig(jobs=[]))
    fault: Literal["kill-leased-rank", "fail-transfer", "stuck-lease"] | None = None
    # Where ranks compute: `cuda` is one GPU per rank over NCCL, `cpu` gloo ranks (the default, as
    # this is the tiny CPU example), `auto` cuda when CUDA is available. `transport: host` stages EP
    # and expert-transfer tensors through host memory over gloo, so several ranks can share one GPU
    # (the one-GPU check, tests/gpu/); never for production.
    device: DeviceChoice = "cpu"
    transport: TransportChoice = "direct"
    # On a GPU the KV cache may take this share of the device's memory, less what is in use after
    # the weights are loaded (nano-vllm's rule), up to max_batch_per_rank slots; on CPU it has
    # max_batch_per_rank slots.
    kv_memory_fraction: float = 0.9
    # The KV cache (rollout/kv/): `slots` (one per request at the longest length) or `paged`
    # (pages of kv_page_size positions: as many bytes as the slots, or kv_pages pages per rank;
    # GRPO group prefix sharing; admission by predicted length keeping kv_reserve of the pages
    # free for requests that outlive their prediction, else preemption and recompute).
    kv: Literal[KV_CACHES] = "paged"
    kv_page_size: int = 16
    kv_pages: int | None = None
    kv_reserve: float = 0.1
    # Partial rollouts (off by default): the batch is the launched groups, the rollout ends when
    # batch.prompts / (1 + over_sample) of them are complete; the report counts what would carry.
    partial: PartialConfig = field(default_factory=PartialConfig)

    def __post_init__(self):
        # The layout, built once here (not a field: `--print-config` prints the fields) and handed
        # down; with a checkpoint its config.json's experts decide it (`rollout_plan.model_config`).
        self.dims = None
        if self.checkpoint is None:
            self.dims = parallel_dims(self.ranks, self.model.num_moe_experts, self.backend)
            self.model.require_page_fits(self.kv_page_size, "kv_page_size")  # a checkpoint's: rollout_plan
        else:
            require(self.ranks > 0, f"ranks: expected > 0, got {self.ranks}")
        require(self.max_batch_per_rank > 0, f"max_batch_per_rank: expected > 0, got {self.max_batch_per_rank}")
        require_size(self.max_batch_per_rank, "max_batch_per_rank")
        require(self.status_interval > 0, f"status_interval: expected > 0, got {self.status_interval}")
        require_timeout(self.timeout_s)
        require_seed(self.seed)
        require_seed(self.sampling.seed, "sampling.seed")
        require(0 < self.kv_memory_fraction <= 1,
                f"kv_memory_fraction: expected in (0, 1], got {self.kv_memory_fraction}")
        # The KV kind, decided once here as the layout is (not a field) and handed down: rollout/kv/kind.py.
        self.kv_kind = kv_kind(self.kv, self.kv_page_size, self.kv_pages, self.kv_reserve)
        if self.floor is not None:
            require_floor(self.floor, self.ranks)
        require_policy(self.policy, self.backend)
        self.partial.require_groups("rollout")

    @staticmethod
    def upgrade(data: dict) -> dict:
        """An earlier file's flat lease fields (`leases: [jobs]`, `lease_s`, `lease_grace_s`,
        `sidecar`) moved under `leases:` (`LeaseConfig`, as `flexfloor train` has them)."""
        flat = {"lease_s": "lease_s", "lease_grace_s": "grace_s", "sidecar": "sidecar"}
        if not isinstance(data.get("leases"), list) and not flat.keys() & data.keys():
            return data
        data = dict(data)
        leases = data.pop("leases", None)
        leases = {"jobs": leases} if isinstance(leases, list) else dict(leases or {})
        for old, new in flat.items():
            if old in data:
                leases[new] = data.pop(old)
        data["leases"] = {"jobs": [], **leases}
        return data
