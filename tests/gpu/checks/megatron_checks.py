"""The megatron backend's GPU checks, as functions: tests/gpu/test_megatron_*.py run them with
megatron-core's layers on a GPU; their comparison logic also runs on CPU between two torch-backend
models (tests/unit/tools/test_megatron_checks.py), so a check that cannot fail is caught here.

- `greedy_agreement`: model B's greedy tokens against model A's on A's own greedy sequences
  (teacher-forced), everywhere and where A's top-1/top-2 logit margin is large;
- `grad_agreement`: GRPO-loss gradients of two bf16 models against an fp32 reference, parameter
  by parameter under the torch backend's names (`canonical_parameters`);
- `loss_falls`: a few optimizer steps of the GRPO surrogate on a fixed batch lower it;
- `elastic_vs_vanilla`: a 2-rank elastic rollout with block owners against vanilla (same sha256).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.models.megatron_weights import canonical_parameters
from megatron_rl.rl.update.grpo import LossBatch, policy_loss
from megatron_rl.rl.update.train_step import Packed, pack, sequence_logprobs
from megatron_rl.trainer_config import GRPOConfig
from tests.gpu.checks.gpu_checks import SMALL_QWEN3_MOE

# The GPU checks' model (tests/gpu/checks/gpu_checks.py's): small enough for minutes on one GPU, with
# Qwen3-30B-A3B's routing width; these checks draw it at the default init std.
CHECK_CONFIG = replace(SMALL_QWEN3_MOE, init_method_std=MoEModelConfig.init_method_std)


def same_weights(reference: Qwen3MoeModel, dtype: torch.dtype, device) -> Qwen3MoeModel:
    """A torch-backend copy of `reference` in `dtype` on `device`."""
    model = Qwen3MoeModel(reference.config, dtype=dtype)
    model.load_state_dict(reference.state_dict())
    return model.to(device)


# Where bf16's rounding cannot flip the argmax, in standard deviations of that step's logits (as
# tests/gpu/checks/gpu_checks.py's greedy check): an absolute margin would depend on the model's logit scale
# (an absolute 0.5 was above every margin of CHECK_CONFIG, whose logits have std ~0.45).
GENERATION_MARGIN_STD = 0.2


@torch.no_grad()
def greedy_agreement(a, b, prompts_BS: torch.Tensor, steps: int, margin: float = GENERATION_MARGIN_STD) -> dict:
    """A generates `steps` greedy tokens (full recompute, no cache); B predicts each of them from
    the same prefix. `ok`: B agrees wherever A's top-1 beats its top-2 by more than `margin`
    standard deviations of A's logits at that step, and there is such a step."""
    ids, tokens, margins = prompts_BS, [], []
    for _ in range(steps):
        logits = a(ids)[:, -1].float()
        top = logits.topk(2, dim=-1)
        tokens.append(top.indices[:, 0])
        margins.append((top.values[:, 0] - top.values[:, 1]) / logits.std(dim=-1))
        ids = torch.cat([ids, top.indices[:, :1]], dim=1)
    want_BT, margin_BT = torch.stack(tokens, 1), torch.stack(margins, 1)
    S = prompts_BS.shape[1]
    got_BT = b(ids[:, :-1])[:, S - 1:].float().argmax(-1)
    agree, large = got_BT == want_BT, margin_BT > margin
    return {"steps": agree.numel(), "agreement": agree.float().mean().item(),
            "large_margin_steps": int(large.sum()),
            "large_margin_agreement": agree[large].float().mean().item() if large.any() else float("nan"),
            "ok": bool(large.any() and agree[large].all())}


def grpo_batch(cfg: MoEModelConfig, rows: int, prompt_len: int, response_len: int, seed: int,
               device) -> tuple[Packed, torch.Tensor]:
    """Random prompts and responses with +-1 advantages: a fixed GRPO micro-batch."""
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randint(1, cfg.vocab_size, (prompt_len,), generator=g).tolist(),
             torch.randint(1, cfg.vocab_size, (response_len,), generator=g).tolist()) for _ in range(rows)]
    packed = pack(data, pad_id=0)
    packed = Packed(*(t.to(device) for t in (packed.input_ids, packed.targets, packed.loss_mask,
                                             packed.token_mask)))
    adv = (torch.arange(rows) % 2 * 2 - 1).to(device, torch.float64)
    return packed, adv


def grpo_loss(model, packed: Packed, advantages: torch.Tensor, old_logp: torch.Tensor | None = None):
    logp = sequence_logprobs(model, packed)
    old = logp.detach() if old_logp is None else old_logp
    loss, _ = policy_loss(logp, LossBatch(old, advantages, packed.loss_mask), GRPOConfig(clip_low=0.2, clip_high=0.2),
                          normalizer=max(packed.tokens, 1))
    return loss


def _grads(model) -> dict[str, torch.Tensor]:
    # megatron-core's DDP accumulates into `main_grad`, a plain backward into `grad`; an expert no
    # token reached has none (torch) or zeros (megatron): zeros for both. Our GroupedMM expert module
    # (megatron's experts where TransformerEngine is missing, as on the bare H200) holds each layer's
    # experts as one stacked parameter: an expert's weight is a view of it, with no grad of its own,
    # and its gradient is its slice of the stacked parameter's (as tests/megatron_rank_checks.py
    # reads it). Read as zeros, every expert's gradient "differed" by its whole scale.
    out = {}
    for k, p in canonical_parameters(model).items():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        out[k] = torch.zeros(p.shape) if g is None else g.detach().float().cpu()
    for i, layer in enumerate(model.decoder.layers):
        experts = getattr(getattr(layer.mlp, "layer", None), "experts", None)
        if getattr(experts, "fc1_E2FD", None) is None:
            continue
        for j, e in enumerate(layer.mlp.local_experts):
            pre = f"decoder.layers.{i}.mlp.experts.local_experts.{e}."
            for name, stacked in (("linear_fc1.weight", experts.fc1_E2FD), ("linear_fc2.weight", experts.fc2_EDF)):
                g = getattr(stacked, "main_grad", None)
                g = stacked.grad if g is None else g
                if g is not None:
                    out[pre + name] = g[j].detach().float().cpu()
    return out


def grad_agreement(reference, a, b, packed: Packed, advantages: torch.Tensor) -> dict:
    """One backward of the GRPO loss through each model (same weights, same batch, one device); B's
    gradient error against the fp32 `reference` must be within twice A's (the torch backend in the
    same dtype) plus 1% of the gradient's scale, parameter by parameter."""
    grads = []
    for model in (reference, a, b):
        model.zero_grad(set_to_none=True)
        grpo_loss(model, packed, advantages).backward()
        grads.append(_grads(model))
    ref, ga, gb = grads
    worst, bad = 0.0, []
    for k, r in ref.items():
        scale = r.abs().max().item()
        if scale == 0:
            continue
        ea, eb = (ga[k] - r).abs().max().item(), (gb[k] - r).abs().max().item()
        worst = max(worst, eb / scale)
        if eb > 2 * ea + 1e-2 * scale:
            bad.append(k)
    return {"params": len(ref), "compared": sorted(ref) == sorted(ga) == sorted(gb),
            "worst_relative_error": worst, "outside_tolerance": bad[:5],
            "ok": not bad and sorted(ref) == sorted(ga) == sorted(gb)}


def loss_falls(model, packed: Packed, advantages: torch.Tensor, zero_grad: Callable[[], None],
               step: Callable[[], object], steps: int = 5) -> dict:
    """`steps` optimizer steps of the GRPO surrogate on a fixed batch against the first policy."""
    with torch.no_grad():
        old = sequence_logprobs(model, packed)
    losses = []
    for _ in range(steps):
        zero_grad()
        loss = grpo_loss(model, packed, advantages, old)
        loss.backward()
        step()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(grpo_loss(model, packed, advantages, old).item())
    return {"losses": losses, "ok": losses[-1] < losses[0]}


def elastic_vs_vanilla(fields: dict) -> dict:
    """A 2-rank elastic rollout (planned, floor 1: the EP group shrinks to rank 0 with megatron's
    blocks) against vanilla on the same weights; `fields` are RolloutConfig fields (backend, device,
    dtype). Needs two GPUs: megatron-core's dispatcher talks to the EP group directly."""
    from megatron_rl.rollout.config import BatchConfig, RolloutConfig
    from megatron_rl.rollout_runner import run_rollouts

    batch = BatchConfig(prompts=6, samples=2, epochs=3, length_scale=0.004)
    cfgs = [RolloutConfig(ranks=2, policy=p, floor=1, batch=batch, **fields) for p in ("vanilla", "planned")]
    vanilla, planned = (r.report for r in run_rollouts(cfgs, quiet=True))
    return {"stages": planned["stages"], "final_stage": planned["final_stage"], "moe": planned["moe"],
            "sha256": planned["responses_sha256"],
            "ok": planned["responses_sha256"] == vanilla["responses_sha256"] and len(planned["stages"]) > 1}
