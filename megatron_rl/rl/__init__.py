"""The training loop's parts, by concept: the update (`update/`: GRPO's math in `grpo.py`, free of
models, ranks and I/O so it can be tested by hand, and what this package exports; the log-prob
recompute and policy update; the training-inference mismatch), the optimizers (`optim/`: fp32
masters, ZeRO-1 and its CPU Adam offload, megatron-core's), `train`'s rollout phase
(`rollout_phase/`, over `rollout/rank_rollout.py`, with partial rollouts and leases) and checkpoints
(`checkpoint/`); beside them the SFT warm start, model setup, validation, what the driver checks of
the inputs, the one-line step faults, the deadline and rank 0's log of the run."""
from megatron_rl.rl.update.grpo import (
    STAT_KEYS,
    LossBatch,
    finalize_stats,
    group_advantages,
    kl_k3,
    policy_loss,
    token_logprobs,
)

__all__ = ["STAT_KEYS", "LossBatch", "finalize_stats", "group_advantages", "kl_k3", "policy_loss", "token_logprobs"]
