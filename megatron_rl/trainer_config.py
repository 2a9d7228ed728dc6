"""`flexfloor train` configuration: GRPO post-training of a Qwen3-MoE on W ranks.

Every section is a dataclass validated on construction; `examples/tiny_cpu_grpo.yaml` (runs here)
and `examples/qwen3_30b_a3b_16xh100.yaml` (the paper's target) both load through `TrainerConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from elastic.planning.policies import POLICIES
from megatron_rl.backend_rules import BACKENDS, backend_rules
from megatron_rl.config import (
    parse_time,
    require,
    require_rollout_size,
    require_seconds,
    require_seed,
    require_size,
    require_timeout,
)
from megatron_rl.data.prompts import DataConfig
from megatron_rl.data.tokenizer import SPECIALS, TokenizerConfig
from megatron_rl.metrics.logger import LoggingConfig
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.parallel.device import DeviceChoice
from megatron_rl.parallel.dims import parallel_dims, require_floor, require_policy
from megatron_rl.partial_config import PartialConfig
from megatron_rl.rewards import RewardConfig
from megatron_rl.rollout.kv.kind import KV_CACHES, kv_kind
from megatron_rl.rollout.leases.jobs import LeaseConfig


@dataclass
class GRPOConfig:
    group_size: int = 8  # responses sampled per prompt
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0  # > 0 keeps a frozen reference model and adds kl_coef x k3 KL per token
    tis_cap: float | None = None  # truncated importance sampling against rollout log-probs
    std_normalize: bool = True  # false: Dr. GRPO (advantages centred, not scaled)
    minibatches: int = 1  # optimizer steps per rollout; each on 1/minibatches of every rank's rows
    micro_batch: int = 16  # rows per forward pass (gradient accumulation inside a minibatch)
    # Rollout routing replay (R3, models/routes.py): every training forward routes each token
    # through the experts the rollout chose for it; the gates are the current router's.
    routing_replay: bool = False
    # Masked importance sampling: drop tokens (mis_level token) or whole responses (sequence)
    # whose rollout/train probability ratio lies outside [lo, hi]; beside or instead of tis_cap.
    mis_bounds: tuple[float, float] | None = None
    mis_level: Literal["token", "sequence"] = "token"

    def __post_init__(self):
        require(self.group_size >= 2, f"grpo.group_size: expected >= 2, got {self.group_size}")
        require(0 <= self.clip_low < 1 and self.clip_high >= 0,
                f"grpo.clip_low/clip_high: expected 0 <= low < 1 and high >= 0, got "
                f"{self.clip_low}/{self.clip_high}")
        require(self.kl_coef >= 0, f"grpo.kl_coef: expected >= 0, got {self.kl_coef}")
        require(self.tis_cap is None or self.tis_cap > 0, f"grpo.tis_cap: expected > 0, got {self.tis_cap}")
        require(self.minibatches >= 1 and self.micro_batch >= 1, "grpo.minibatches/micro_batch: expected >= 1")
        require(isinstance(self.routing_replay, bool),
                f"grpo.routing_replay: expected true or false, got {self.routing_replay!r}")
        if self.mis_bounds is not None:
            b = self.mis_bounds
            require(isinstance(b, (list, tuple)) and len(b) == 2
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in b) and 0 < b[0] < 1 < b[1],
                    f"grpo.mis_bounds: expected [lo, hi] with 0 < lo < 1 < hi, got {b!r}")
            self.mis_bounds = (float(b[0]), float(b[1]))
        require(self.mis_level in ("token", "sequence"),
                f"grpo.mis_level: expected token or sequence, got {self.mis_level!r}")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # on the global norm over dense and every rank's experts; 0 = off
    # ZeRO-1 (rl/optim/zero.py): each rank keeps the optimizer state of 1/world of the dense parameters.
    # null: on for more than one rank. The megatron backend has its own DistributedOptimizer.
    shard_optimizer: bool | None = None
    # cpu: masters and moments in host memory, stepped by DeepSpeed's CPU Adam (rl/optim/cpu_adam.py).
    offload: Literal["none", "cpu"] = "none"

    def __post_init__(self):
        require(self.offload in ("none", "cpu"), f"optim.offload: expected none or cpu, got {self.offload!r}")
        require(self.lr > 0, f"optim.lr: expected > 0, got {self.lr}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                f"optim.betas: expected two numbers in [0, 1), got {list(self.betas)}")
        require(self.eps > 0 and self.weight_decay >= 0,
                f"optim.eps/weight_decay: expected eps > 0 and weight_decay >= 0, got "
                f"{self.eps}/{self.weight_decay}")
        require(self.grad_clip >= 0, f"optim.grad_clip: expected >= 0, got {self.grad_clip}")


@dataclass
class GenerationConfig:
    max_response_len: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_batch_per_rank: int = 64
    # The KV cache: `slots` or `paged` (rollout/kv/; pages of kv_page_size positions, GRPO group
    # prefix sharing, kv_reserve of the pages kept free at admission).
    kv: Literal[KV_CACHES] = "paged"
    kv_page_size: int = 16
    kv_reserve: float = 0.1

    def __post_init__(self):
        # The KV kind, decided once here (not a field) and handed down: rollout/kv/kind.py.
        self.kv_kind = kv_kind(self.kv, self.kv_page_size, None, self.kv_reserve, "generation.")
        require(self.max_response_len > 0, "generation.max_response_len: expected > 0")
        require(self.temperature > 0, f"generation.temperature: expected > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"generation.top_p: expected in (0, 1], got {self.top_p}")
        # 0 would leave every request waiting for a slot forever (the run hangs).
        require(self.max_batch_per_rank > 0,
                f"generation.max_batch_per_rank: expected > 0, got {self.max_batch_per_rank}")
        require_size(self.max_batch_per_rank, "generation.max_batch_per_rank")
        require_size(self.max_response_len, "generation.max_response_len")


@dataclass
class ElasticConfig:
    """How the rollout phase places responses and shrinks the EP group (see elastic/)."""

    policy: Literal[POLICIES] = "vanilla"
    floor: int | None = None  # default for natural/planned: ranks // 2
    tailguard: bool = False
    status_interval: int = 1
    # A shrink's fixed price (s) on the H100 shape model, for the plans and the online rule alike
    # (`rollout_plan.run_cost`). Default: on CPU this engine's measured step and shrink (10 ms), on
    # GPU the shape model's 0.05 s.
    shrink_cost_s: float | None = None

    def __post_init__(self):
        require(self.status_interval > 0, "elastic.status_interval: expected > 0")
        require(self.shrink_cost_s is None or self.shrink_cost_s >= 0,
                f"elastic.shrink_cost_s: expected >= 0, got {self.shrink_cost_s}")


@dataclass
class WarmStartConfig:
    """Supervised steps on (prompt, answer) before RL, so the first rollouts sometimes succeed."""

    sft_steps: int = 0
    lr: float = 3e-3
    prompts_per_step: int = 32
    # Prompts to learn from, read like data.path (same fields); None: data.path's. A task whose RL
    # set is small (so prompts recur) learns the skill here, not the RL set by heart.
    path: str | None = None

    def __post_init__(self):
        require(self.sft_steps >= 0 and self.prompts_per_step > 0 and self.lr > 0,
                "warmstart: expected sft_steps >= 0, prompts_per_step > 0, lr > 0")


@dataclass
class CheckpointConfig:
    every: int = 10  # steps between checkpoints (the last step is always saved); 0 = last only
    export_hf: bool = True  # write DIR/hf (HuggingFace safetensors) after the last step
    # After SIGTERM/SIGUSR1/Ctrl+C, the ranks finish the step and save; a spawning `flexfloor train`
    # kills them if that takes longer (under torchrun, its --shutdown-timeout decides).
    stop_grace_s: float = 300.0
    # Resume from a checkpoint that has no checksums.json (written elsewhere, or by an old version).
    # Only for checkpoints from a trusted source (docs/training.md, "Checkpoints are data").
    allow_unverified: bool = False
    # Retention (rl/checkpoint/retention.py): the newest keep_last checkpoints, and every
    # keep_every-th step besides (0: none); older ones are removed once a newer one is verified.
    keep_last: int = 3
    keep_every: int = 0
    # Write checkpoints in the background (rl/checkpoint/async_save.py) while the next step runs, after a host
    # copy of the state (host memory: one more copy of this rank's share of the state).
    async_save: bool = False

    def __post_init__(self):
        require(type(self.async_save) is bool,
                f"checkpoint.async_save: expected true or false, got {self.async_save!r}")
        require(self.every >= 0, f"checkpoint.every: expected >= 0, got {self.every}")
        require(type(self.keep_last) is int and self.keep_last >= 1,
                f"checkpoint.keep_last: expected an integer >= 1, got {self.keep_last!r}")
        require(type(self.keep_every) is int and self.keep_every >= 0,
                f"checkpoint.keep_every: expected an integer >= 0 (0: none), got {self.keep_every!r}")
        require_seconds(self.stop_grace_s, "checkpoint.stop_grace_s")


@dataclass
class EvalConfig:
    """Held-out validation (rl/validation.py): pass@1, mean reward, length, and per data source
    verl's val-core/<source>/reward/{mean,best,maj}@N."""

    # held-out prompt file(s), each read like data.path (same fields); disjoint from it
    path: str | list[str] | None = None
    every: int = 0  # evaluate every N steps and before step 1; 0 = never
    max_prompts: int | None = None  # the first N of each file
    n_samples: int = 1  # answers per prompt: 1 is greedy, more are sampled at `temperature`
    temperature: float = 1.0
    log_generations: int = 8  # the first K held-out prompts' answers: W&B table + OUT/val_generations.jsonl

    def __post_init__(self):
        require(self.every >= 0, f"eval.every: expected >= 0, got {self.every}")
        require(self.every == 0 or bool(self.path), "eval.every > 0 needs eval.path (a held-out prompt file)")
        require(all(self.paths), "eval.path: expected file names, got an empty one")
        require(self.max_prompts is None or self.max_prompts > 0,
                f"eval.max_prompts: expected > 0, got {self.max_prompts}")
        require(self.n_samples >= 1, f"eval.n_samples: expected >= 1, got {self.n_samples}")
        require(self.temperature > 0, f"eval.temperature: expected > 0, got {self.temperature}")
        require(self.log_generations >= 0, f"eval.log_generations: expected >= 0, got {self.log_generations}")

    @property
    def paths(self) -> list[str]:
        return [] if self.path is None else [self.path] if isinstance(self.path, str) else list(self.path)


@dataclass
class TrainerConfig:
    model: MoEModelConfig = field(default_factory=MoEModelConfig)
    # A HuggingFace Qwen3-MoE directory to start from; it must have `model`'s shape. None: random
    # init from `seed` (then `warmstart`).
    init: str | None = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig("examples/data/arith_train.jsonl"))
    reward: RewardConfig = field(default_factory=RewardConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    leases: LeaseConfig = field(default_factory=LeaseConfig)  # side work of detached ranks (rl/rollout_phase/leases.py)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Partial rollouts (off by default): over-sample, end when the step's groups are complete, carry
    # the rest over (rl/rollout_phase/partial.py, docs/training.md).
    partial: PartialConfig = field(default_factory=PartialConfig)
    steps: int = 20
    prompts_per_step: int = 8
    seed: int = 0
    ranks: int = 4
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    # MoE implementation for generation and training: `torch` (plain PyTorch, CPU or GPU) or
    # `megatron` (megatron-core's MoELayer, DDP and DistributedOptimizer; GPUs only, see
    # megatron_rl/rl/optim/megatron_train.py).
    backend: Literal[BACKENDS] = "torch"
    timeout_s: float = 300.0  # every collective's timeout
    verify_replicas: bool = True  # after each update, check the replicated weights agree bitwise
    # `cuda`: one GPU per rank over NCCL; `cpu`: gloo ranks; `auto`: cuda when CUDA is available.
    device: DeviceChoice = "cpu"
    # Training memory (docs/training.md): rerun each decoder layer's forward in backward instead of
    # keeping its activations; and compute log-probs this many positions at a time (0 = all at
    # once), so a long response never materialises [tokens, vocab] fp32 logits.
    recompute_activations: bool = False
    logprob_chunk_tokens: int = 1024
    # Save and stop before this time (ISO 8601, or Unix seconds; `--deadline`); under Slurm the
    # job's end less FF_SIGNAL_LEAD_S by default. megatron_rl/rl/deadline.py.
    end_by: str | None = None

    def __post_init__(self):
        W, E = self.ranks, self.model.num_moe_experts
        require(self.steps > 0, f"steps: expected > 0, got {self.steps}")
        require(self.prompts_per_step > 0, f"prompts_per_step: expected > 0, got {self.prompts_per_step}")
        self.dims = parallel_dims(W, E, self.backend)  # built once, handed down (not a field)
        rows = self.prompts_per_step * self.grpo.group_size
        require(rows % (W * self.grpo.minibatches) == 0,
                f"prompts_per_step x grpo.group_size: expected a multiple of ranks x grpo.minibatches "
                f"({W} x {self.grpo.minibatches}: every rank trains on equal shares), got {rows}")
        require(self.warmstart.sft_steps == 0 or self.warmstart.prompts_per_step % W == 0,
                f"warmstart.prompts_per_step: expected a multiple of ranks ({W}), got "
                f"{self.warmstart.prompts_per_step}")
        if self.elastic.floor is not None:
            require_floor(self.elastic.floor, W, "elastic.floor")
        require_policy(self.elastic.policy, self.backend, "elastic.policy")
        if self.tokenizer.kind == "char":
            need = len(SPECIALS) + len(self.tokenizer.alphabet)
            require(self.model.vocab_size >= need,
                    f"model.vocab_size: expected at least the character tokenizer's {need} ids, got "
                    f"{self.model.vocab_size}")
        require_timeout(self.timeout_s)
        require_seed(self.seed)
        require(self.generation.max_response_len < self.model.max_position_embeddings,
                f"generation.max_response_len: expected below model.max_position_embeddings "
                f"({self.model.max_position_embeddings}: a response follows a prompt of at least one "
                f"token), got {self.generation.max_response_len}")
        self.model.require_page_fits(self.generation.kv_page_size, "generation.kv_page_size")
        if self.end_by is not None:
            parse_time(self.end_by, "end_by")
        require(self.logprob_chunk_tokens >= 0,
                f"logprob_chunk_tokens: expected >= 0, got {self.logprob_chunk_tokens}")
        self.partial.require_groups("train")
        over = f" x (1 + partial.over_sample {self.partial.over_sample:g})" if self.partial.enabled else ""
        require_rollout_size(self.partial.groups_launched(self.prompts_per_step), self.grpo.group_size,
                             f"prompts_per_step {self.prompts_per_step}{over}")
        require(not self.partial.enabled or self.grpo.tis_cap is not None,
                "partial.enabled: carried responses mix tokens of older policies; set grpo.tis_cap "
                "(truncated importance sampling from each token's behaviour log-prob)")
        backend_rules(self.backend).require_training(self)
        require(self.optim.offload == "none" or self.dtype != "float64",
                f"optim.offload cpu (fp32 masters stepped by DeepSpeed's CPU Adam): expected dtype bfloat16 "
                f"or float32, got {self.dtype}")

    @property
    def rows_per_rank(self) -> int:
        return self.prompts_per_step * self.grpo.group_size // self.ranks
