"""The training-inference mismatch, measured every step (`mismatch/...`, docs/training.md).

The old-log-prob forward of every micro-batch compares, per token position and MoE layer, the
training router's own top-k set with the one the rollout recorded (models/routes.py), whether
routing replay then uses the recorded one or not; and compares the training policy's log-probs
with the rollout's on the response tokens. Token sums accumulate on the device and are summed over
ranks once per step:

- `router_agreement`: share of (token, layer) pairs whose top-k sets are equal;
- `tokens_any_flip`: share of token positions where at least one layer's set differs;
- `logp_abs_diff_mean` / `_max`: |old - rollout log-prob| per response token (`rollout/logp_gap`);
- `k3_kl`: k3 estimate of KL(rollout policy || training policy) per response token;
- `tis_clip_share`: share of response tokens whose weight exp(old - rollout) exceeds `grpo.tis_cap`;
- `mis_masked_share`, `mis_masked_tokens`: response tokens `grpo.mis_bounds` dropped;
- `rows_without_routes`: responses that had no recorded routes (they train with the training
  router's own choice; only a resumed carried response of an old checkpoint can lack them).
"""
from __future__ import annotations

import torch

from megatron_rl.rl.update.grpo import kl_k3
from megatron_rl.rl.update.stats import sum_over_ranks

# The tally's device sums, in the order they are all-reduced: pairs, agreeing pairs, flipped
# positions, positions with routes, rows without routes, response tokens, k3, tis-clipped tokens,
# mis-masked tokens.
_DEVICE_SUMS = ("pairs", "agree", "flipped", "routed", "missing", "tokens", "k3", "tis_clipped", "mis_masked")


class MismatchTally:
    def __init__(self, device):
        self.sums = {name: torch.zeros((), dtype=torch.float64, device=device) for name in _DEVICE_SUMS}

    def add_routes(self, replay, missing_rows: int) -> None:
        """A micro-batch's `RouteReplay` after its observing forward."""
        s = self.sums
        s["pairs"] += replay.pairs[0]
        s["agree"] += replay.pairs[1]
        s["flipped"] += replay.flip_T.sum().double()
        s["routed"] += replay.has_T.sum().double()
        s["missing"] += missing_rows

    def add_logprobs(self, old_logp, rollout_logp, mask, tis_cap: float | None, keep=None) -> None:
        mask = mask.double()
        old, roll = old_logp.double(), rollout_logp.double()
        s = self.sums
        s["tokens"] += mask.sum()
        s["k3"] += (kl_k3(roll, old) * mask).sum()
        # Left alone, not += 0 * k3: a non-finite step's k3 is NaN, and the counts must stay counts.
        if tis_cap is not None:
            s["tis_clipped"] += ((torch.exp(old - roll) > tis_cap).double() * mask).sum()
        if keep is not None:
            s["mis_masked"] += ((1 - keep.double()) * mask).sum()

    def finish(self, world: int) -> dict[str, float]:
        """The step's measures (module docstring), the sums added over the ranks."""
        v = sum_over_ranks(self.sums, world)
        tokens = max(v["tokens"], 1.0)
        return {"router_agreement": v["agree"] / v["pairs"] if v["pairs"] else None,
                "tokens_any_flip": v["flipped"] / v["routed"] if v["routed"] else None,
                "k3_kl": v["k3"] / tokens, "tis_clip_share": v["tis_clipped"] / tokens,
                "mis_masked_share": v["mis_masked"] / tokens, "mis_masked_tokens": int(v["mis_masked"]),
                "rows_without_routes": int(v["missing"])}
