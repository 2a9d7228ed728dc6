"""Held-out validation during `flexfloor train`: greedy answers to a prompt set the run never trains
on, every `eval.every` steps and once before step 1 (the warm start's figure, verl's
`val_before_train`).

Every rank greedily answers its share of the prompts with the training model itself (the EP layout
of stage 0; no elastic shrink): requests are padded to the same count per rank and generate exactly
`generation.max_response_len` tokens each (`fixed_len`), so every rank makes the same forward
passes (the MoE all-to-all is a collective); each answer is cut at its first EOS, which changes
nothing before it (causal attention, greedy). Reported, summed over ranks:
  pass@1       share of prompts whose greedy answer the verifier marks correct;
  reward_mean  mean reward (`reward.*` credits) of those answers;
  response_len_mean  mean answer length in tokens (EOS included).
Logged as `val/...` (metric_keys.py; verl: `val-core/<source>/reward/mean@1`).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_rl.data.prompts import Prompt, load_prompts
from megatron_rl.rewards import CORRECT, Scorer


def load_heldout(cfg) -> list[Prompt]:
    """The held-out prompts (`eval.path`, read like `data.path`), at most `eval.max_prompts`."""
    prompts = load_prompts(replace(cfg.data, path=cfg.eval.path)).prompts
    return prompts[: cfg.eval.max_prompts] if cfg.eval.max_prompts else prompts


@torch.no_grad()
def evaluate(model, tok, prompts: list[Prompt], reward_cfg, max_new: int, rank: int, world: int) -> dict:
    from megatron_rl.rollout.engine import Request, RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    per = math.ceil(len(prompts) / world)
    mine = list(range(rank * per, min((rank + 1) * per, len(prompts))))
    padded = mine + [0] * (per - len(mine))  # filler answers (prompt 0) keep the passes equal; not counted
    encoded = [tok.encode(prompts[i].text) for i in padded]
    longest = max(len(tok.encode(p.text)) for p in prompts)
    engine = RolloutEngine(model, SamplingParams(greedy=True), per, longest + max_new, tok.eos_id)
    engine.add([Request(f"v{j}", 0, ids, max_new, fixed_len=max_new) for j, ids in enumerate(encoded)])
    was_training = model.training
    model.eval()
    while engine.has_work():
        engine.step()
    model.train(was_training)
    answers = {int(r.prompt_id[1:]): r.tokens for r in engine.finished}
    scorer = Scorer(reward_cfg)
    sums = torch.zeros(4, dtype=torch.float64)  # prompts, correct, reward, tokens
    for j, i in enumerate(mine):
        tokens = answers[j]
        if tok.eos_id in tokens:
            tokens = tokens[: tokens.index(tok.eos_id) + 1]
        outcome = scorer.outcome(tok.decode(tokens), prompts[i].answer)
        sums += torch.tensor([1.0, float(outcome == CORRECT), scorer.credit(outcome), len(tokens)],
                             dtype=torch.float64)
    if world > 1:
        sums = sums.to(model.device)
        dist.all_reduce(sums)
    n, correct, reward, tokens = (float(x) for x in sums)
    return {"pass@1": correct / n, "reward_mean": reward / n, "response_len_mean": tokens / n,
            "prompts": int(n)}
