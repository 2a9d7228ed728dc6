"""Per-update diagnostics of the policy update (what tells a bf16 run from an fp32 one, docs/gpu.md):

- `update_rel`: the step's size on the model's weights, ||w_after - w_before|| / ||w_before||, over
  the whole model (dense once, every rank's experts), in the dtype the rollout uses;
- `update_changed`: the share of weights the step changed at all (a bf16 weight moves only when its
  master crosses a rounding boundary);
- `ppo_kl`: k3 KL between the old policy and the policy at the update's forward, per token
  (verl's `actor/ppo_kl`; 0 on a single minibatch's first forward);
- `rollout_gap`, `rollout_gap_max`: |old log-prob - rollout log-prob| per response token, mean
  and max: the training-inference mismatch (what `grpo.tis_cap` corrects).

`sum_over_ranks` adds a step's named device sums over the ranks in one all-reduce (these figures,
the loss's, rl/update/mismatch.py's). `WeightDelta` keeps a copy of this rank's weights across one
optimizer step (the weights' size in memory, during the update only, when the rollout's KV cache is
freed).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_rl.models.params import is_expert_param


def sum_over_ranks(sums: dict[str, torch.Tensor], world: int) -> dict[str, float]:
    """`sums` (float64 scalars on one device) added over the ranks, by name: one all-reduce of them
    stacked in their order, so a rank reads every figure back in one host transfer."""
    flat = torch.stack(list(sums.values()))
    if world > 1:
        dist.all_reduce(flat)
    return dict(zip(sums, flat.tolist()))


class WeightDelta:
    def __init__(self, model):
        self.before = [(n, p.detach().clone()) for n, p in model.named_parameters()]

    @torch.no_grad()
    def measure(self, model, world: int) -> tuple[float, float]:
        """(update_rel, update_changed) of the step taken since construction."""
        params = dict(model.named_parameters())
        dev = next(iter(params.values())).device
        dense = torch.zeros(4, dtype=torch.float64, device=dev)  # delta^2, weight^2, changed, count
        expert = torch.zeros(4, dtype=torch.float64, device=dev)
        for n, old in self.before:
            d = (params[n].detach() - old).double()
            part = expert if is_expert_param(n) else dense
            part += torch.stack([d.pow(2).sum(), old.double().pow(2).sum(), (d != 0).sum().double(),
                                 torch.tensor(float(d.numel()), dtype=torch.float64, device=dev)])
        if world > 1:
            dist.all_reduce(expert)  # experts are disjoint across ranks; dense weights are replicas
        total = dense + expert
        return math.sqrt(float(total[0]) / max(float(total[1]), 1e-300)), float(total[2]) / max(float(total[3]), 1.0)
