"""The RL algorithm's math (GRPO), kept free of models, ranks and I/O so it can be tested by hand."""
from megatron_rl.rl.grpo import (
    STAT_KEYS,
    finalize_stats,
    group_advantages,
    kl_k3,
    policy_loss,
    token_logprobs,
)

__all__ = ["STAT_KEYS", "finalize_stats", "group_advantages", "kl_k3", "policy_loss", "token_logprobs"]
