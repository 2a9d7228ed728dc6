"""What one rank of tests/distributed/test_megatron_harness.py runs under the megatron-core CPU
harness (tests/megatron_harness.py): megatron-core's real MoELayer (both dispatchers, both
local expert modules), DDP and DistributedOptimizer against the torch backend on the same weights
and the same batches. Returns plain values for the test to assert on; rank 0's reach the test."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.trainer_config import OptimConfig
from tests.gpu.checks.megatron_checks import grpo_batch, grpo_loss

CFG = MoEModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                     num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, vocab_size=64)
STEPS = 3
OPTIM = OptimConfig(lr=3e-3, grad_clip=1.0)


def _torch_model(rank: int, world: int, held=None) -> Qwen3MoeModel:
    from elastic.planning.dims import block_owners
    from megatron_rl.models.ep_dispatch import AllToAllDispatcher
    from megatron_rl.models.moe import LocalDispatcher

    owners = block_owners(CFG.num_moe_experts, range(world))
    held = [e for e, rs in owners.items() if rank in rs] if held is None else held
    model = Qwen3MoeModel(CFG, held, torch.float32)
    model.init_weights(7)
    model.set_dispatcher(LocalDispatcher() if world == 1 or len(held) == CFG.num_moe_experts else
                         AllToAllDispatcher(dist.group.WORLD, [owners[e][0] for e in sorted(owners)]))
    return model


def _megatron_model(rank: int, world: int, dispatcher: str, expert_module: str) -> Qwen3MoeModel:
    from megatron_rl.models.megatron_backend import install_megatron_moe
    from megatron_rl.rl.optim.megatron_train import training_groups

    model = _torch_model(rank, world)
    install_megatron_moe(model, training_groups(rank, world), dispatcher=dispatcher, dtype=torch.float32,
                         expert_module=expert_module, device="cpu")
    return model


def _batches(world: int, step: int = 0):
    """Every rank's micro-batch (equal shapes: the allgather dispatcher needs equal token counts)."""
    return [grpo_batch(CFG, rows=2, prompt_len=4, response_len=6, seed=100 * step + r, device="cpu")
            for r in range(world)]


def _grads(model, world: int) -> dict[str, torch.Tensor]:
    """Gradients under the torch backend's names, dense ones summed over the world, every rank's
    experts gathered: the whole model's gradient of the loss over every rank's batch."""
    from megatron_rl.models.megatron_weights import canonical_parameters

    out, experts = {}, {}
    for k, p in canonical_parameters(model).items():
        g = p.grad
        if g is None and p.grad_fn is not None:  # a view of GroupedMM's stacked parameter
            continue
        g = torch.zeros_like(p) if g is None else g.detach().clone()
        if ".local_experts." in k:
            experts[k] = g
        else:
            if world > 1:
                dist.all_reduce(g)
            out[k] = g
    if any(getattr(p, "fc1_E2FD", None) is not None for p in model.modules()):
        for layer_i, layer in enumerate(model.decoder.layers):
            moe = layer.mlp
            w1, w2 = moe.layer.experts.fc1_E2FD.grad, moe.layer.experts.fc2_EDF.grad
            for j, e in enumerate(moe.local_experts):
                pre = f"decoder.layers.{layer_i}.mlp.experts.local_experts.{e}."
                experts[pre + "linear_fc1.weight"], experts[pre + "linear_fc2.weight"] = w1[j], w2[j]
    every = [experts]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, experts)
    for part in every:
        out.update(part)
    return out


def _loss_over_world(model, batches, rank: int, world: int, old_logp=None):
    """This rank's share of the GRPO loss over every rank's batch, normalised by all their tokens."""
    packed, adv = batches[rank]
    total = sum(b[0].tokens for b in batches)
    return grpo_loss(model, packed, adv, old_logp) * packed.tokens / total


def layer_checks(rank: int, world: int, combos) -> dict:
    """Logits and gradients of megatron's layer against the torch backend, for both dispatchers and
    both local expert modules; the alltoall layer with zero tokens on rank 0 (defect 2)."""
    reference = _torch_model(0, 1, held=list(range(CFG.num_moe_experts)))
    batches = _batches(world)
    ref_loss = sum(grpo_loss(reference, p, a) * p.tokens for p, a in batches) / sum(p.tokens for p, _ in batches)
    ref_loss.backward()
    ref_grads = _grads(reference, 1)
    ids = batches[rank][0].input_ids
    with torch.no_grad():
        ref_logits = reference(ids)
    out = {}
    for dispatcher, module in combos:
        model = _megatron_model(rank, world, dispatcher, module)
        with torch.no_grad():
            logits_err = (model(ids) - ref_logits).abs().max().item()
        _loss_over_world(model, batches, rank, world).backward()
        grads = _grads(model, world)
        assert sorted(grads) == sorted(ref_grads), sorted(set(grads) ^ set(ref_grads))[:4]
        grad_err = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
        errs = torch.tensor([logits_err, grad_err])
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        out[f"{dispatcher}/{module}"] = errs.tolist()
        if dispatcher == "alltoall":
            x = torch.zeros(0, CFG.hidden_size) if rank == 0 else torch.randn(3, CFG.hidden_size)
            with torch.no_grad():
                out[f"zero_tokens/{module}"] = list(model.moe_layers[0](x).shape)
    out["grad_scale"] = max(g.abs().max().item() for g in ref_grads.values())
    return out


def _train(model, step_fn, zero_fn, rank: int, world: int, steps) -> list[float]:
    """GRPO steps on one batch against the policy the batch came from (the first one), as the
    updates after one rollout are: the clipped surrogate moves as the policy does."""
    from megatron_rl.rl.update.train_step import sequence_logprobs

    batches = _batches(world)
    reference = _torch_model(rank, world)  # the weights every model here starts from
    with torch.no_grad():
        old = sequence_logprobs(reference, batches[rank][0])
    losses = []
    for _ in steps:
        zero_fn()
        loss = _loss_over_world(model, batches, rank, world, old)
        loss.backward()
        step_fn()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _torch_steps(model, opt, rank: int, world: int):
    from megatron_rl.rl.update.train_step import allreduce_dense_grads, clip_global_grad_norm

    def step():
        named = list(model.named_parameters())
        allreduce_dense_grads(named, world)
        clip_global_grad_norm(named, OPTIM.grad_clip, world)
        opt.step()
    return step


def training_checks(rank: int, world: int, ckpt_dir: str | None) -> dict:
    """GRPO steps with megatron-core's DDP + DistributedOptimizer against the torch backend's AdamW
    on the same batches; then a checkpoint (rl/checkpoint/dcp.py with the megatron optimizer's shards)
    and a resume into a fresh model and optimizer, whose next step must equal the uninterrupted one
    bit for bit (when `ckpt_dir` is given)."""
    from elastic.trace import Trace
    from megatron_rl.models.megatron_weights import canonical_state_dict
    from megatron_rl.rl.checkpoint.dcp import load_checkpoint, save_checkpoint
    from megatron_rl.rl.optim.megatron_train import MegatronOptimizer, training_groups
    from megatron_rl.rl.update.train_step import make_optimizer

    plain = _torch_model(rank, world)
    adamw = make_optimizer(plain, OPTIM.lr, OPTIM.betas, OPTIM.eps, OPTIM.weight_decay)
    torch_losses = _train(plain, _torch_steps(plain, adamw, rank, world),
                          lambda: adamw.zero_grad(set_to_none=True), rank, world, range(STEPS))

    def megatron():
        model = _megatron_model(rank, world, "alltoall", "GroupedMM")
        return model, MegatronOptimizer(model, CFG, OPTIM, torch.float32, training_groups(rank, world))

    model, opt = megatron()
    lr = opt.param_groups[0]["lr"]  # defect 4: the trainer logs it after every step
    if ckpt_dir is None:
        losses = _train(model, opt.finish_step, opt.zero_grad, rank, world, range(STEPS))
        return {"torch_losses": torch_losses, "megatron_losses": losses, "lr": lr}
    losses = _train(model, opt.finish_step, opt.zero_grad, rank, world, range(STEPS - 1))
    save_checkpoint(ckpt_dir, STEPS - 1, model, opt, None, {}, Trace([], "history"), rank)
    losses += _train(model, opt.finish_step, opt.zero_grad, rank, world, [STEPS - 1])
    after = canonical_state_dict(model)

    resumed, ropt = megatron()
    from pathlib import Path

    load_checkpoint(Path(ckpt_dir) / "checkpoints" / f"step_{STEPS - 1:06d}", resumed, ropt, None)
    resumed_loss = _train(resumed, ropt.finish_step, ropt.zero_grad, rank, world, [STEPS - 1])
    again = canonical_state_dict(resumed)
    same = all(torch.equal(after[k], again[k]) for k in after)
    flags = torch.tensor([float(same)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return {"torch_losses": torch_losses, "megatron_losses": losses, "lr": lr,
            "resumed_loss": resumed_loss[0], "resume_bit_identical": bool(flags.item())}


def rank_main(ctx, combos, ckpt_dir: str | None) -> dict:
    rank, world = ctx.rank, ctx.world
    torch.set_num_threads(1)
    return {"layers": layer_checks(rank, world, combos), "training": training_checks(rank, world, ckpt_dir)}
