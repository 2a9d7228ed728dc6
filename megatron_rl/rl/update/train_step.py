"""The pieces of an expert-parallel training step, shared by GRPO and the SFT warm start.

Parallel layout (the rollout's stage 0, Megatron's default): attention, norms, router and
embeddings are replicated on every rank (data parallel over the world); expert e lives on rank
e // (E / W) only (expert parallel over the world). Each rank runs forward/backward on its own rows;
the MoE all-to-all carries tokens to the owners and, in backward, their gradients back, so an
expert's gradient accumulates on its owner from every rank's tokens and is never all-reduced. Dense
gradients are summed across ranks. Losses are token sums divided by the *global* token count, so the
summed gradient equals a single process's gradient on the whole batch.

Every rank must make the same number of forward and backward passes (each MoE layer's all-to-all is
a collective): the trainer gives every rank the same number of rows and micro-batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_rl.models.params import is_expert_param, tensor_digest
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rl.optim.cpu_adam import deepspeed_cpu_adam
from megatron_rl.rl.optim.mixed_precision import MixedPrecisionOptimizer, grad_params, needs_masters
from megatron_rl.rl.optim.zero import DenseLayout, ShardedOptimizer
from megatron_rl.rl.update.grpo import token_logprobs, token_logprobs_entropy


@dataclass
class Packed:
    """Right-padded rows of prompt + response; position t predicts token t + 1."""

    input_ids: torch.Tensor  # [B, S]
    targets: torch.Tensor  # [B, S]
    loss_mask: torch.Tensor  # [B, S] 1.0 where the target is a response token
    token_mask: torch.Tensor  # [B, S] True on real (non-padding) input tokens

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device) -> "Packed":
        return Packed(*(t.to(device) for t in (self.input_ids, self.targets, self.loss_mask, self.token_mask)))


def pack(rows: list[tuple[list[int], list[int]]], pad_id: int) -> Packed:
    """`rows` of (prompt ids, response ids) -> one padded micro-batch."""
    S = max(len(p) + len(r) for p, r in rows) - 1
    B = len(rows)
    ids = torch.full((B, S + 1), pad_id, dtype=torch.long)
    loss = torch.zeros(B, S)
    real = torch.zeros(B, S, dtype=torch.bool)
    for b, (p, r) in enumerate(rows):
        n = len(p) + len(r)
        ids[b, :n] = torch.tensor(p + r, dtype=torch.long)
        loss[b, len(p) - 1 : n - 1] = 1.0
        real[b, : n - 1] = True
    return Packed(ids[:, :-1], ids[:, 1:].clone(), loss, real)


def sequence_logprobs(model, packed: Packed, temperature: float = 1.0, chunk_tokens: int = 0,
                      entropy: bool = False):
    """log p(target) at every position [B, S], logits scaled by the sampling temperature; with
    `entropy`, the pair (log-probs, the policy's entropy at every position [B, S], no gradient).

    `chunk_tokens` > 0 computes them that many positions at a time from the final hidden states
    (`chunked_logprobs`), so the [B, S, V] logits and their fp32 copy never exist at once."""
    if chunk_tokens <= 0:
        logits = model(packed.input_ids, token_mask_BS=packed.token_mask)
        return _scaled_logprobs(logits, packed.targets, temperature, entropy)
    hidden = model.hidden_states(packed.input_ids, token_mask_BS=packed.token_mask)
    return chunked_logprobs(hidden, model.output_weight(), packed.targets, temperature, chunk_tokens,
                            entropy)


def chunked_logprobs(hidden_BSD: torch.Tensor, weight_VD: torch.Tensor, targets_BS: torch.Tensor,
                     temperature: float, chunk_tokens: int, entropy: bool = False):
    """log p(target) [B, S] (and the entropy [B, S] with `entropy`) from hidden states,
    `chunk_tokens` positions at a time.

    Under autograd each chunk is checkpointed: forward keeps only its slice of the hidden states,
    and backward recomputes that chunk's logits, so one chunk's [chunk, V] fp32 logits are the
    most that is ever alive, forward or backward. Same ops per position as the unchunked path."""
    B, S, D = hidden_BSD.shape
    h_TD, t_T = hidden_BSD.reshape(B * S, D), targets_BS.reshape(B * S)
    grad = torch.is_grad_enabled()
    out = []
    for i in range(0, B * S, chunk_tokens):
        args = (h_TD[i : i + chunk_tokens], weight_VD, t_T[i : i + chunk_tokens], temperature, entropy)
        out.append(checkpoint(_linear_logprobs, *args, use_reentrant=False) if grad
                   else _linear_logprobs(*args))
    if entropy:
        return torch.cat([lp for lp, _ in out]).view(B, S), torch.cat([h for _, h in out]).view(B, S)
    return torch.cat(out).view(B, S)


def _linear_logprobs(h_TD, weight_VD, targets_T, temperature: float, entropy: bool):
    return _scaled_logprobs(F.linear(h_TD, weight_VD), targets_T, temperature, entropy)


def _scaled_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    if temperature != 1.0:
        logits = logits / temperature
    return token_logprobs_entropy(logits, targets) if entropy else token_logprobs(logits, targets)


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def allreduce_dense_grads(named: list[tuple[str, torch.Tensor]], world: int) -> None:
    """Sum the replicated parameters' gradients over the world, in the gradients' own dtype (fp32
    on the masters under mixed precision): one reduce-scatter and one all-gather of ZeRO-1's flat
    layout (`zero.DenseLayout`), so every element is summed in the order ZeRO-1 sums it.

    `named`: (name, parameter) pairs whose `.grad` the optimizer steps on (`grad_params`)."""
    if world == 1:
        return
    params = [p for n, p in named if not is_expert_param(n)]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    layout = DenseLayout([p.numel() for p in params], world)
    flat = torch.zeros(world * layout.run, dtype=params[0].grad.dtype, device=params[0].device)
    for i, p in enumerate(params):
        flat[layout.start(i) : layout.start(i) + p.numel()].copy_(p.grad.reshape(-1))
    flat = layout.all_gather(layout.reduce_scatter(flat))
    for i, p in enumerate(params):
        p.grad.copy_(flat[layout.start(i) : layout.start(i) + p.numel()].view_as(p))


def clip_global_grad_norm(named: list[tuple[str, torch.Tensor]], max_norm: float, world: int) -> float:
    """The gradient norm over the whole model (dense once, every rank's experts) and clip to it.

    Dense gradients are identical on every rank after `allreduce_dense_grads`; expert gradients are
    disjoint across ranks, so their squared norms are summed over the world.
    """
    device = named[0][1].device if named else torch.device("cpu")
    dense_sq = torch.zeros((), dtype=torch.float64, device=device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=device)
    grads = []
    for name, p in named:
        if p.grad is None:
            continue
        grads.append(p)
        sq = p.grad.detach().double().pow(2).sum()
        if is_expert_param(name):
            expert_sq += sq
        else:
            dense_sq += sq
    if world > 1:
        dist.all_reduce(expert_sq)
    total = math.sqrt(float(dense_sq + expert_sq))
    if max_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, torch.tensor(total))
    return total


def make_optimizer(model: torch.nn.Module, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 0.0):
    """torch AdamW over this rank's parameters: expert state lives with the expert's owner, dense
    state is replicated like the dense weights (the optimizer is sharded as the weights are).

    A bf16/fp16 model gets AdamW over fp32 master weights (`rl/optim/mixed_precision.py`); fp32 and
    fp64 models step directly."""
    def adamw(params):
        return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)

    if needs_masters(model):
        return MixedPrecisionOptimizer(model, adamw)
    return adamw(model.parameters())


def training_optimizer(model: torch.nn.Module, optim, rank: int, world: int, lr: float | None = None):
    """The torch backend's optimizer for `optim` (an OptimConfig) on this rank: ZeRO-1 and/or host
    offload (`ShardedOptimizer`, rl/optim/zero.py) when asked (sharding by default for more than one
    rank), else `make_optimizer`'s replicated one. `lr` overrides `optim.lr` (the SFT warm start)."""
    lr = optim.lr if lr is None else lr
    shard = world > 1 if optim.shard_optimizer is None else optim.shard_optimizer
    offload = optim.offload == "cpu"
    if not (shard or offload):
        return make_optimizer(model, lr, optim.betas, optim.eps, optim.weight_decay)

    def inner(params):
        if offload:
            return deepspeed_cpu_adam(params, lr, optim.betas, optim.eps, optim.weight_decay)
        return torch.optim.AdamW(params, lr=lr, betas=tuple(optim.betas), eps=optim.eps,
                                 weight_decay=optim.weight_decay)

    return ShardedOptimizer(model, inner, rank if shard else 0, world if shard else 1, optim.grad_clip,
                            offload=offload, is_expert=is_expert_param)


def optimizer_step(optimizer, model: torch.nn.Module, grad_clip: float, world: int) -> float:
    """Reduce the gradients, clip them to the global norm, step; returns the norm before clipping.
    Optimizers that reduce their own gradients (ZeRO-1's reduce-scatter, megatron-core's DDP
    buckets) do all of it in `finish_step`."""
    if hasattr(optimizer, "finish_step"):
        return optimizer.finish_step()
    named = grad_params(model, optimizer)
    allreduce_dense_grads(named, world)
    norm = clip_global_grad_norm(named, grad_clip, world)
    optimizer.step()
    return norm


def check_replicas(model: torch.nn.Module, world: int) -> None:
    """Every rank's replicated weights are bitwise equal (after the update, before the next rollout)."""
    if world == 1:
        return
    mine = {n: tensor_digest(p) for n, p in model.named_parameters() if not is_expert_param(n)}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    bad = sorted(n for n in mine if any(d[n] != every[0][n] for d in every))
    if bad:
        raise RuntimeError(f"replicated weights diverged across ranks after the update: {bad[:5]}")


def frozen_copy(model):
    """A copy of this rank's shard (same experts, same dispatcher) with gradients off: the KL
    reference. Built, not deep-copied: the dispatcher holds a process group, which cannot be copied."""
    copy = Qwen3MoeModel(model.config, model.moe_layers[0].experts.held(), model.dtype).to(model.device)
    copy.load_state_dict(model.state_dict())
    copy.set_dispatcher(model.moe_layers[0].dispatcher)
    return copy.requires_grad_(False)
