"""The bodies of the GPU checks (tests/gpu/, run by tools/gpu_check.sh), written for any device so
that their CPU side is tested without a GPU (tests/unit/tools/test_gpu_checks.py runs them small on CPU).

(a) `greedy_vs_reference`: our engine generates greedily on the device in its dtype; a float64 CPU
    copy of the same weights re-reads every generated sequence (teacher forcing) and names its own
    greedy token and logit margin (top-1 minus top-2) at each step. Where the margin is large the
    tokens must be equal; the agreement rate over all steps is reported.
    `grpo_steps`: GRPO steps through the trainer's own pieces (`Trainer`, `RolloutPhase`,
    `PolicyUpdate`) with a shaped reward (the share of even token ids, so every group has signal):
    after each update the clipped surrogate on that step's batch must be lower than before it.
(b) `elastic_on_one_device`: vanilla and natural floor 1 rollouts of 2 ranks over the host-staged
    transport (both ranks on one GPU), float64 greedy: shrink, expert moves, restore, checksums,
    identical responses.
"""
from __future__ import annotations

import tempfile
from dataclasses import replace

import torch

from megatron_rl.models.config import MoEModelConfig
from tests.helpers import REPO

# The small Qwen3-MoE of check (a): 4 layers, hidden 512, 64 experts, top-8. The larger init std
# gives logits with clear winners, so that "large margin" covers most steps.
SMALL_QWEN3_MOE = MoEModelConfig(
    num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4, kv_channels=64,
    num_moe_experts=64, moe_router_topk=8, moe_ffn_hidden_size=256, vocab_size=4096, init_method_std=0.05)
# The same model shrunk for the checks' CPU runs (tests/unit): seconds, not minutes.
TINY_QWEN3_MOE = replace(SMALL_QWEN3_MOE, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                         kv_channels=16, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, vocab_size=256)


def _model(mcfg: MoEModelConfig, seed: int, dtype: torch.dtype, device: str):
    from megatron_rl.models.qwen3_moe import Qwen3MoeModel

    with torch.device("cpu"):  # init_weights draws from CPU generators
        model = Qwen3MoeModel(mcfg, None, dtype)
        model.init_weights(seed)
    return model.to(device).eval()


def greedy_vs_reference(mcfg: MoEModelConfig = SMALL_QWEN3_MOE, *, device: str = "cuda",
                        dtype: torch.dtype = torch.bfloat16, batch: int = 8, prompt_len: int = 16,
                        new_tokens: int = 32, margin: float = 0.2, min_large: float = 0.2,
                        seed: int = 0) -> dict:
    """Greedy tokens of our engine on `device`/`dtype` against the float64 CPU reference; passes
    when they agree wherever the reference's margin is large, and at least `min_large` of the
    steps have a large margin (else the check would say nothing)."""
    from megatron_rl.rollout.engine import Request, RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed + 1)
    prompts = torch.randint(0, mcfg.vocab_size, (batch, prompt_len), generator=g).tolist()
    engine = RolloutEngine(_model(mcfg, seed, dtype, device), SamplingParams(greedy=True), batch,
                           prompt_len + new_tokens)
    engine.add([Request(f"p{i}", 0, p, new_tokens, fixed_len=new_tokens) for i, p in enumerate(prompts)])
    while engine.has_work():
        engine.step()
    generated = [r.tokens for r in sorted(engine.finished, key=lambda r: int(r.prompt_id[1:]))]
    reference = _model(mcfg, seed, torch.float64, "cpu")
    with torch.no_grad():
        ids = torch.tensor([p + t for p, t in zip(prompts, generated)])
        logits = reference(ids)[:, prompt_len - 1:-1]  # the logits that chose each generated token
    top2 = logits.topk(2, dim=-1)
    ref_tokens, gap = top2.indices[..., 0], top2.values[..., 0] - top2.values[..., 1]
    agree = ref_tokens == torch.tensor(generated)
    # Large: a gap of at least `margin` standard deviations of that step's logits (a random model's
    # logits are not peaked; bf16 moves them by about 1% of their spread).
    large = gap > margin * logits.std(dim=-1)
    out = {"steps": agree.numel(), "agreement": float(agree.float().mean()), "large_margin_steps": int(large.sum()),
           "large_margin_agreement": float(agree[large].float().mean()) if large.any() else float("nan"),
           "ok": bool(agree[large].all()) and int(large.sum()) >= min_large * agree.numel(),
           "evidence": {"tokens compared": agree.numel()}}
    out["summary"] = (f"{out['agreement']:.1%} of {out['steps']} tokens agree; {out['large_margin_agreement']:.1%} "
                      f"of the {out['large_margin_steps']} with a large margin")
    return out


def _shaped_rewards(responses) -> torch.Tensor:
    return torch.tensor([sum(t % 2 == 0 for t in r.tokens) / max(len(r.tokens), 1) for r in responses],
                        dtype=torch.float64)


def _grpo_rank(ctx, cfg, steps: int, out_dir: str) -> dict:
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.rl.update.grpo import LossBatch, group_advantages, policy_loss
    from megatron_rl.rl.update.train_step import sequence_logprobs
    from megatron_rl.trainer import build_trainer

    trainer = build_trainer(cfg, load_prompts(cfg.data), ctx, out_dir, None)
    g, T = cfg.grpo, cfg.generation.temperature
    before, after, reward, signal = [], [], [], []
    for step in range(1, steps + 1):
        batch = trainer.iterator.next_batch()
        rollout = trainer.rollout.run(step, [trainer.data[i] for i in batch.indices], trainer.history)
        rewards = _shaped_rewards(rollout.responses)
        advantages = group_advantages(rewards, g.group_size)
        # A step whose groups all scored alike has zero advantages: nothing to lower, not judged.
        signal.append(bool(torch.as_tensor(advantages).abs().max() > 0))
        recomputed = trainer.update.recompute_logprobs(trainer.update.minibatches(rollout.responses, advantages))
        before.append(trainer.update.update(recomputed)["loss"])
        with torch.no_grad():  # the same surrogate, on the same batch, with the updated weights
            after.append(sum(float(policy_loss(sequence_logprobs(trainer.model, mb.packed, T),
                                               LossBatch(mb.old_logp, mb.advantages, mb.packed.loss_mask), g,
                                               normalizer=max(batch.tokens, 1))[0])
                             for batch in recomputed.batches for mb in batch.micro) / len(recomputed.batches))
        reward.append(float(rewards.mean()))
    judged = [(b, a) for b, a, s in zip(before, after, signal) if s]
    return {"loss_before": before, "loss_after": after, "reward": reward, "signal": signal,
            "ok": len(judged) > 0 and all(a < b for b, a in judged), "evidence": {"GRPO updates": len(after)},
            "summary": "surrogate before -> after update: "
                       + ", ".join(f"{b:+.3f}->{a:+.3f}" + ("" if s else " (no signal)")
                                   for b, a, s in zip(before, after, signal))
                       + f"; reward {reward[0]:.2f} -> {reward[-1]:.2f}"}


def grpo_config(mcfg: MoEModelConfig = SMALL_QWEN3_MOE, *, device: str = "cuda", dtype: str = "bfloat16",
                prompts_per_step: int = 4, group_size: int = 8, max_response_len: int = 16, lr: float = 1e-3):
    """The trainer config of the GRPO checks: one rank, one minibatch per step, no KL or TIS."""
    from megatron_rl.config import load_dataclass
    from megatron_rl.trainer_config import TrainerConfig

    cfg = load_dataclass(TrainerConfig, REPO / "examples" / "tiny_cpu_grpo.yaml", {
        "ranks": 1, "device": device, "dtype": dtype, "prompts_per_step": prompts_per_step,
        "grpo.group_size": group_size, "grpo.micro_batch": prompts_per_step * group_size, "grpo.minibatches": 1,
        "grpo.kl_coef": 0.0, "grpo.tis_cap": None, "optim.lr": lr, "logging.wandb_mode": "disabled",
        "generation.max_response_len": max_response_len, "warmstart.sft_steps": 0, "eval.every": 0,
        "data.path": str(REPO / "examples" / "data" / "arith_train.jsonl"), "elastic.policy": "vanilla"})
    return replace(cfg, model=mcfg)


def grpo_steps(mcfg: MoEModelConfig = SMALL_QWEN3_MOE, *, device: str = "cuda", dtype: str = "bfloat16",
               steps: int = 5, prompts_per_step: int = 4, group_size: int = 8, max_response_len: int = 16,
               lr: float = 1e-4) -> dict:
    """`steps` GRPO steps on one rank; the surrogate loss before and after each update.

    lr 1e-4, not 1e-3: at 1e-3 one AdamW step moves this model's policy by a KL of 1.7 to 236 nats
    per token, where a first-order check means nothing; on the same rollouts fp32 then raises its
    surrogate on the same steps as bf16 (tools/grpo_precision.py, docs/gpu.md)."""
    from megatron_rl.parallel.launch import run_ranks

    cfg = grpo_config(mcfg, device=device, dtype=dtype, prompts_per_step=prompts_per_step,
                      group_size=group_size, max_response_len=max_response_len, lr=lr)
    with tempfile.TemporaryDirectory() as out:
        return run_ranks(_grpo_rank, 1, cfg, steps, out, timeout_s=600, device=device)


def elastic_on_one_device(*, device: str = "cuda", prompts: int = 8, samples: int = 4,
                          length_scale: float = 0.01) -> dict:
    """Vanilla, natural floor 1 and adaptive floor 1 (its live requests moved with their KV cache
    through the transport) on 2 ranks sharing `device` through the host-staged transport."""
    from megatron_rl.config import load_dataclass
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout_runner import run_rollouts

    base = {"ranks": 2, "device": device, "transport": "host", "batch.prompts": prompts,
            "batch.samples": samples, "batch.length_scale": length_scale, "timeout_s": 120.0}
    cfgs = [load_dataclass(RolloutConfig, None, {**base, "policy": policy, **extra})
            for policy, extra in (("vanilla", {}), ("natural", {"floor": 1}), ("adaptive", {"floor": 1}))]
    runs = run_rollouts(cfgs, quiet=True)
    vanilla, natural, adaptive = (r.report for r in runs)
    responses = runs[0].responses
    same = natural["responses_sha256"] == vanilla["responses_sha256"]
    moved_same = adaptive["responses_sha256"] == vanilla["responses_sha256"]
    freed = {r: sum(f.values()) for r, f in natural["freed_bytes"].items()}
    return {"device": natural["device"], "final_stage": natural["final_stage"], "freed_bytes": natural["freed_bytes"],
            "migrated": adaptive["migrated"],
            "ok": natural["final_stage"] == 1 and same and adaptive["migrated"] > 0 and moved_same,
            "evidence": {"rollouts": len(cfgs), "responses per rollout": len(responses)},
            "summary": f"on {natural['device']}: stage {natural['final_stage']} reached, shrink "
                       f"{sum(natural['shrink_latency_s'].values()):.3f} s, restore {natural['restore_s']:.3f} s, "
                       f"freed bytes by rank {freed}; adaptive moved {adaptive['migrated']} live requests "
                       f"(sha256 {'equals' if moved_same else 'differs from'} vanilla's); natural's sha256 "
                       f"{natural['responses_sha256'][:12]} "
                       + ("equals vanilla's" if same else f"differs from vanilla's {vanilla['responses_sha256'][:12]}")}
