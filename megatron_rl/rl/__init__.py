"""The training loop's parts: GRPO's math (`grpo.py`, free of models, ranks and I/O so it can be
tested by hand, and what this package exports), the update step and mixed precision, `train`'s
rollout phase (over `rollout/rank_rollout.py`) and its leases, checkpoints, the SFT warm start,
model setup and megatron-core training."""
from megatron_rl.rl.grpo import (
    STAT_KEYS,
    finalize_stats,
    group_advantages,
    kl_k3,
    policy_loss,
    token_logprobs,
)

__all__ = ["STAT_KEYS", "finalize_stats", "group_advantages", "kl_k3", "policy_loss", "token_logprobs"]
