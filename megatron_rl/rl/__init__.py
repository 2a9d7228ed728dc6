"""The training loop's parts: GRPO's math (`grpo.py`, free of models, ranks and I/O so it can be
tested by hand, and what this package exports), the update step, mixed precision, ZeRO-1 and its
CPU Adam offload, `train`'s rollout phase (over `rollout/rank_rollout.py`) and its leases,
checkpoints, the SFT warm start, model setup and megatron-core training; beside the loop, what the
driver checks of the inputs, the one-line step faults, and rank 0's log of the run."""
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
