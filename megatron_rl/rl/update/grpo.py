"""GRPO as pure tensor functions: group-normalised advantages and the clipped policy-gradient loss.

Shapes: responses are rows `[B, T]` (B = prompts x group size, groups contiguous), `mask` is 1 on
response tokens and 0 on padding. Log-probs are of the token actually sampled.

Three log-probs meet in the loss:
  - `logp`: the policy being trained (carries the gradient);
  - `old_logp`: the same weights before this update, recomputed by the trainer; PPO clipping
    bounds `exp(logp - old_logp)`. With one optimizer step per rollout it equals `logp.detach()`;
  - `rollout_logp`: what the rollout engine reported while sampling. It differs from `old_logp`
    only by numerics (kernels, batch shapes, precision); truncated importance sampling reweights
    each token by `min(exp(old_logp - rollout_logp), tis_cap)` to correct that mismatch.

The loss is a sum over tokens divided by `normalizer`: pass the token count of the *global* batch
so that data-parallel ranks, each summing its own rows, all-reduce to exactly the single-process
gradient (a per-rank mean would weight ranks with short responses more).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rl.trainer_config import GRPOConfig

STAT_KEYS = ("tokens", "clipped", "ratio", "kl", "tis_weight")


def mis_keep(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
             bounds: tuple[float, float], level: str) -> torch.Tensor:
    """Masked importance sampling (verl's `rollout_is` mask modes): 1 where a response token
    trains, 0 where its rollout/train ratio exp(old_logp - rollout_logp) falls outside `bounds`
    (`level` "token"), or where its sequence's ratio, the product over its tokens, does
    ("sequence": the whole response is dropped). Padding stays 1 (the loss mask drops it)."""
    lo, hi = bounds
    log_ratio = (old_logp.double() - rollout_logp.double()) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    inside = (log_ratio >= math.log(lo)) & (log_ratio <= math.log(hi))
    return (inside | (mask == 0)).to(old_logp.dtype)


def group_advantages(
    rewards: torch.Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """(r - mean of its group) / (unbiased std of its group + eps); groups are contiguous rows.

    A group whose rewards are all equal gets advantage 0 (no signal), not NaN.
    `std_normalize=False` is Dr. GRPO's variant (centre only).
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(
            f"group_advantages: {rewards.numel()} rewards do not split into groups of {group_size} "
            "(a group needs at least 2 samples)"
        )
    r = rewards.reshape(-1, group_size).to(torch.float64)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) under `logits` [..., V], computed in float32 whatever the logits' dtype."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and `token_entropy` from one float32 log-softmax over the vocabulary (the
    update asks for both on every micro-batch); the entropy carries no gradient."""
    logp_V = F.log_softmax(logits.float(), dim=-1)
    with torch.no_grad():
        entropy = -(logp_V.exp() * logp_V).sum(-1)
    return logp_V.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


@torch.no_grad()
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the policy's next-token distribution at every position [...], in float32."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token: e^d - d - 1, d = ref - logp.

    Non-negative and unbiased for samples drawn from the policy.
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@dataclass
class LossBatch:
    """What the loss reads of one micro-batch besides the trained policy's log-probs: rows `[B, S]`
    (`advantages` `[B]`); `ref_logp` only with a KL reference, `rollout_logp` only under
    `grpo.tis_cap`, `keep` (`mis_keep`) only under `grpo.mis_bounds`."""

    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logp: torch.Tensor | None = None
    rollout_logp: torch.Tensor | None = None
    keep: torch.Tensor | None = None


def policy_loss(logp: torch.Tensor, batch: LossBatch, g: GRPOConfig,
                normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss (`g.clip_low`/`clip_high`, + `g.kl_coef` x k3 KL), summed over
    tokens / `normalizer`; `batch.keep` zeroes the tokens masked importance sampling drops.

    Returns the loss and detached token *sums* of the statistics in STAT_KEYS (all-reduce them
    across ranks, then divide by the summed `tokens`).
    """
    mask = batch.mask.to(logp.dtype)
    adv = batch.advantages.to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - batch.old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - g.clip_low, 1.0 + g.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    stats = {
        "tokens": mask.sum().detach(),
        "clipped": ((clipped < unclipped).to(mask.dtype) * mask).sum().detach(),
        "ratio": (ratio.detach() * mask).sum(),
    }
    if batch.rollout_logp is not None and g.tis_cap is not None:
        weight = torch.exp(batch.old_logp - batch.rollout_logp).clamp(max=g.tis_cap).detach()
        per_token = per_token * weight
        stats["tis_weight"] = (weight * mask).sum()
    else:
        stats["tis_weight"] = stats["tokens"].clone()
    if batch.ref_logp is not None:
        kl = kl_k3(logp, batch.ref_logp)
        stats["kl"] = (kl.detach() * mask).sum()
        if g.kl_coef:
            per_token = per_token + g.kl_coef * kl
    else:
        stats["kl"] = torch.zeros((), dtype=logp.dtype)
    if batch.keep is not None:
        per_token = per_token * batch.keep
    denom = normalizer if normalizer is not None else stats["tokens"].clamp(min=1.0)
    return (per_token * mask).sum() / denom, stats


def finalize_stats(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Token sums from `policy_loss` (possibly all-reduced) -> per-token means."""
    n = max(float(sums["tokens"]), 1.0)
    return {
        "clip_frac": float(sums["clipped"]) / n,
        "ratio_mean": float(sums["ratio"]) / n,
        "kl": float(sums["kl"]) / n,
        "tis_weight_mean": float(sums["tis_weight"]) / n,
    }
