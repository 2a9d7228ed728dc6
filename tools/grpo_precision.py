"""bf16 against fp32 GRPO on the same rollouts, one row per update (the bf16 GRPO check of
tools/gpu_check.sh, docs/gpu.md):

    python tools/grpo_precision.py [--device cpu|cuda] [--lr 1e-4] [--steps 5]

Two trainers start from the same weights (the bf16 model's, upcast for the fp32 one): GRPO check
(a)'s small Qwen3-MoE, shaped reward, one minibatch per step. Each step the bf16 model generates
the rollout and both update on it (each with its own old log-probs). Per update and precision:
the surrogate before and after the update on that batch, the relative update size, the share of
weights changed, the clip fraction, the KL to the old policy after the update, the rollout-vs-train
log-prob gap and the gradient norm. One more column judges the bf16 update in fp32 (the bf16
weights before and after, upcast, evaluated by an fp32 copy), which separates a bad bf16 update
from a noisy bf16 evaluation of a good one.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.gpu.checks import gpu_checks  # noqa: E402

COLUMNS = ("before", "after", "update_rel", "update_changed", "clip_frac", "kl_after", "rollout_gap",
           "grad_norm")


def _surrogate(model, batches, g, T, old32=None) -> tuple[float, float]:
    """(clipped surrogate, k3 KL to the old policy per token) of `model` on `batches` (`Minibatch`es
    with their old log-probs; `old32`: other old log-probs, one per micro-batch in order)."""
    from megatron_rl.rl.update.grpo import LossBatch, kl_k3, policy_loss
    from megatron_rl.rl.update.train_step import sequence_logprobs

    loss = kl = tokens = 0.0
    olds = iter(old32 or [])
    with torch.no_grad():
        for batch in batches:
            for mb in batch.micro:
                logp = sequence_logprobs(model, mb.packed, T)
                old = next(olds) if old32 is not None else mb.old_logp
                loss += float(policy_loss(logp, LossBatch(old, mb.advantages, mb.packed.loss_mask), g,
                                          normalizer=max(batch.tokens, 1))[0])
                kl += float((kl_k3(logp.double(), old.double()) * mb.packed.loss_mask).sum())
                tokens += float(mb.packed.loss_mask.sum())
    return loss / len(batches), kl / max(tokens, 1.0)


def _fp32_copy(model):
    """An fp32 evaluator with `model`'s weights upcast (same experts and dispatcher)."""
    from megatron_rl.models.qwen3_moe import Qwen3MoeModel

    copy = Qwen3MoeModel(model.config, model.moe_layers[0].experts.held(), torch.float32).to(model.device)
    copy.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    copy.set_dispatcher(model.moe_layers[0].dispatcher)
    return copy.eval()


def _compare_rank(ctx, cfg16, cfg32, steps: int, out_dir: str) -> dict:
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.rl.update.grpo import group_advantages
    from megatron_rl.rl.update.train_step import sequence_logprobs
    from megatron_rl.trainer import build_trainer

    data = load_prompts(cfg16.data)
    t16 = build_trainer(cfg16, data, ctx, out_dir + "/bf16", None)
    t32 = build_trainer(cfg32, data, ctx, out_dir + "/fp32", None)
    with torch.no_grad():
        for p32, p16 in zip(t32.model.parameters(), t16.model.parameters()):
            p32.copy_(p16.float())
    g, T = cfg16.grpo, cfg16.generation.temperature
    rows = []
    for step in range(1, steps + 1):
        batch = t16.iterator.next_batch()
        torch.manual_seed(step)
        rollout = t16.rollout.run(step, [t16.data[i] for i in batch.indices], t16.history)
        rewards = gpu_checks._shaped_rewards(rollout.responses)
        advantages = group_advantages(rewards, g.group_size)
        row = {"step": step, "reward": float(rewards.mean()),
               "signal": bool(torch.as_tensor(advantages).abs().max() > 0)}
        judge = _fp32_copy(t16.model)  # the bf16 weights before the update, judged in fp32
        for name, t in (("bf16", t16), ("fp32", t32)):
            recomputed = t.update.recompute_logprobs(t.update.minibatches(rollout.responses, advantages))
            batches = recomputed.batches
            if name == "bf16":
                old32 = [sequence_logprobs(judge, mb.packed, T) for batch in batches for mb in batch.micro]
            stats = t.update.update(recomputed)
            t.optimizer.zero_grad(set_to_none=True)
            after, kl = _surrogate(t.model, batches, g, T)
            row[name] = {"before": stats["loss"], "after": after, "update_rel": stats["update_rel"],
                         "update_changed": stats["update_changed"], "clip_frac": stats["clip_frac"],
                         "kl_after": kl, "rollout_gap": stats["rollout_gap"], "grad_norm": stats["grad_norm"]}
            if name == "bf16":
                before32, _ = _surrogate(judge, batches, g, T, old32)
                after32, _ = _surrogate(_fp32_copy(t16.model), batches, g, T, old32)
                row["bf16_judged_fp32"] = {"before": before32, "after": after32}
        rows.append(row)
    return {"rows": rows}


def compare(*, device: str = "cpu", lr: float = 1e-4, steps: int = 5, mcfg=gpu_checks.SMALL_QWEN3_MOE,
            **shape) -> dict:
    """`shape`: grpo_config's prompts_per_step, group_size, max_response_len (small CPU tests)."""
    from megatron_rl.parallel.launch import run_ranks

    cfg16 = gpu_checks.grpo_config(mcfg, device=device, dtype="bfloat16", lr=lr, **shape)
    cfg32 = replace(cfg16, dtype="float32")
    with tempfile.TemporaryDirectory() as out:
        result = run_ranks(_compare_rank, 1, cfg16, cfg32, steps, out, timeout_s=1200, device=device)
    result["ok"] = verdict(result["rows"])
    return result


# A first-order check ("the update lowers its own surrogate") says something only for a step that
# stays near the old policy; PPO practice keeps the per-token KL of an update around 0.01-0.1.
TRUST_KL = 0.5


def verdict(rows: list[dict]) -> bool:
    """bf16 passes when, on every update with signal, it lowers its surrogate within the trust
    region (KL to the old policy <= TRUST_KL per token) and matches fp32 on the same rollout: its
    surrogate drop within 10% of fp32's (+ 1e-3)."""
    judged = [r for r in rows if r["signal"]]

    def good(r):
        b, f = r["bf16"], r["fp32"]
        drop16, drop32 = b["before"] - b["after"], f["before"] - f["after"]
        return drop16 > 0 and b["kl_after"] <= TRUST_KL and abs(drop16 - drop32) <= 0.1 * abs(drop32) + 1e-3

    return bool(judged) and all(good(r) for r in judged)


def table(rows: list[dict]) -> str:
    head = ("| step | reward | precision | surrogate before -> after | update rel | changed | clip frac "
            "| KL after | rollout gap | grad norm |")
    out = [head, "|" + " --- |" * 10]
    for r in rows:
        for name in ("bf16", "fp32"):
            c = r[name]
            out.append(f"| {r['step']} | {r['reward']:.2f} | {name} | {c['before']:+.4f} -> {c['after']:+.4f} "
                       f"| {c['update_rel']:.2e} | {c['update_changed']:.1%} | {c['clip_frac']:.3f} "
                       f"| {c['kl_after']:.2e} | {c['rollout_gap']:.2e} | {c['grad_norm']:.3f} |")
        j = r["bf16_judged_fp32"]
        out.append(f"| {r['step']} | | bf16 update, fp32 judge | {j['before']:+.4f} -> {j['after']:+.4f} "
                   "| | | | | | |")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    """One line for the GPU check's table: bf16's surrogate before -> after per update, its update
    size against fp32's, and the bf16 update judged in fp32."""
    return "; ".join(f"{r['step']}: {r['bf16']['before']:+.3f}->{r['bf16']['after']:+.3f}"
                     f" (fp32 judge {r['bf16_judged_fp32']['before']:+.3f}->{r['bf16_judged_fp32']['after']:+.3f},"
                     f" rel {r['bf16']['update_rel']:.1e} vs fp32 {r['fp32']['update_rel']:.1e})"
                     + ("" if r["signal"] else " no signal") for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    result = compare(device=args.device, lr=args.lr, steps=args.steps)
    print(table(result["rows"]))
    print(f"bf16 lowered its surrogate within the trust region (KL <= {TRUST_KL}) and matched fp32 on every "
          f"update with signal: {result['ok']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
