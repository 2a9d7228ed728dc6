"""Held-out validation during `flexfloor train`: answers to prompt sets the run never trains on,
every `eval.every` steps and once before step 1 (the warm start's figure, verl's
`val_before_train`).

Every rank answers its share of the prompts with the training model itself (the EP layout of
stage 0; no elastic shrink): `eval.n_samples` answers each, greedy for 1, else sampled at
`eval.temperature` (seeded by the run's seed and the step). Requests are padded to the same count
per rank and generate exactly `generation.max_response_len` tokens each (`fixed_len`), so every
rank makes the same forward passes (the MoE all-to-all is a collective); each answer is cut at its
first EOS, which changes nothing before it (causal attention). Reported on rank 0:
  val/pass@1       share of answers the verifier marks correct (a custom reward: full credit,
                   score >= reward.correct_reward);
  val/reward_mean  mean reward (`reward.*` credits) of the answers;
  val/response_len_mean, val/prompts;
  val-core/<data_source>/reward/mean@N, best@N/mean, maj@N/mean   verl's names, per data source:
                   the mean reward, the mean over prompts of the best of the N answers' rewards,
                   and of the reward of the answer most of the N gave (ties: the first given).
Every evaluation also writes the answers to the first `eval.log_generations` held-out prompts to
`OUT/val_generations.jsonl` and to the W&B table `val/generations` (verl's
`trainer.log_val_generations`).
"""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.data.prompts import Prompt, load_prompts
from megatron_rl.rewards import CORRECT, SCORED, Scorer
from megatron_rl.rl.rollout_phase.phase import step_seed
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams

GENERATION_COLUMNS = ["step", "data_source", "prompt_id", "prompt", "response", "ground_truth", "score"]


def load_heldout(cfg) -> list[Prompt]:
    """The held-out prompts of every `eval.path` file (each read like `data.path`), in order, at
    most `eval.max_prompts` of each."""
    prompts = []
    for path in cfg.eval.paths:
        rows = load_prompts(replace(cfg.data, path=path)).prompts
        prompts += rows[: cfg.eval.max_prompts] if cfg.eval.max_prompts else rows
    return prompts


@torch.no_grad()
def _answers(model, tok, prompts: list[Prompt], rank: int, world: int, n: int, max_new: int,
             temperature: float, seed: int) -> dict[tuple[int, int], list[int]]:
    """(prompt index, sample) -> answer tokens (cut after the first EOS) of this rank's share."""
    per = math.ceil(len(prompts) / world)
    mine = list(range(rank * per, min((rank + 1) * per, len(prompts))))
    padded = mine + [0] * (per - len(mine))  # filler answers (prompt 0) keep the passes equal; not kept
    # Request ids are global prompt indices, so sampled draws differ between ranks and prompts.
    ids = [str(i) if j < len(mine) else f"pad{j}" for j, i in enumerate(padded)]
    sampling = SamplingParams(greedy=True) if n == 1 else SamplingParams(temperature, greedy=False, seed=seed)
    longest = max(len(tok.encode_prompt(p)) for p in prompts)
    engine = RolloutEngine(model, sampling, per * n, longest + max_new, tok.eos_id)
    engine.add([Request(rid, s, tok.encode_prompt(prompts[i]), max_new, fixed_len=max_new)
                for rid, i in zip(ids, padded) for s in range(n)])
    was_training = model.training
    model.eval()
    while engine.has_work():
        engine.step()
    model.train(was_training)
    out = {}
    for r in engine.finished:
        if not r.prompt_id.startswith("pad"):
            cut = r.tokens[: r.tokens.index(tok.eos_id) + 1] if tok.eos_id in r.tokens else r.tokens
            out[(int(r.prompt_id), r.sample)] = cut
    return out


def _per_prompt(scorer: Scorer, tok, prompts: list[Prompt], answers: dict) -> list[dict]:
    """Each answered prompt's figures: its N answers' rewards, correctness, lengths and texts."""
    rows: dict[int, dict] = {}
    for (i, _), tokens in sorted(answers.items()):
        text = tok.decode(tokens)
        verdict = scorer.judge(text, prompts[i])
        reward = scorer.credit(verdict)
        correct = verdict.outcome == CORRECT or (verdict.outcome == SCORED and reward >= scorer.cfg.correct_reward)
        row = rows.setdefault(i, {"index": i, "rewards": [], "correct": [], "lengths": [], "texts": []})
        row["rewards"].append(reward)
        row["correct"].append(correct)
        row["lengths"].append(len(tokens))
        row["texts"].append(text)
    return list(rows.values())


def _majority_reward(row: dict) -> float:
    votes = Counter(t.strip() for t in row["texts"])
    top = max(votes.values())
    first = next(j for j, t in enumerate(row["texts"]) if votes[t.strip()] == top)
    return row["rewards"][first]


def summarize(rows: list[dict], prompts: list[Prompt], n: int) -> dict:
    """`val` and `val_core` metrics (module docstring) of every rank's per-prompt rows."""
    answers = [(r, j) for r in rows for j in range(len(r["rewards"]))]
    val = {"pass@1": sum(r["correct"][j] for r, j in answers) / len(answers),
           "reward_mean": sum(r["rewards"][j] for r, j in answers) / len(answers),
           "response_len_mean": sum(r["lengths"][j] for r, j in answers) / len(answers),
           "prompts": len(rows)}
    by_source: dict[str, list[dict]] = {}
    for r in rows:
        by_source.setdefault(prompts[r["index"]].data_source, []).append(r)
    core = {}
    for source, group in sorted(by_source.items()):
        core[source] = {"reward": {
            f"mean@{n}": sum(sum(r["rewards"]) / len(r["rewards"]) for r in group) / len(group),
            f"best@{n}/mean": sum(max(r["rewards"]) for r in group) / len(group),
            f"maj@{n}/mean": sum(_majority_reward(r) for r in group) / len(group)}}
    return {"val": val, "val_core": core}


@dataclass(frozen=True)
class Validation:
    """One evaluation: `val` and `val_core` metrics, and the first generations as the metrics
    logger's W&B table (`val/generations`); both empty off rank 0."""

    metrics: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)


class Validator:
    """The held-out prompts of a run; `run` evaluates them."""

    def __init__(self, cfg, out_dir: Path):
        self.cfg, self.out_dir = cfg, Path(out_dir)
        self.prompts = load_heldout(cfg)
        self.scorer = Scorer(cfg.reward)

    def run(self, model, tok, rank: int, world: int, step: int) -> Validation:
        """Evaluate (a collective: every rank calls it); rank 0 gets the figures, the others none."""
        ev = self.cfg.eval
        answers = _answers(model, tok, self.prompts, rank, world, ev.n_samples,
                           self.cfg.generation.max_response_len, ev.temperature, step_seed(self.cfg.seed, step))
        rows = _per_prompt(self.scorer, tok, self.prompts, answers)
        self.scorer.take_counts()
        self.scorer.take_extras()
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, rows)
            rows = [r for part in parts for r in part]
        if rank != 0:
            return Validation()
        generations = self._write_generations(step, rows)
        tables = {"val/generations": (GENERATION_COLUMNS, generations)} if generations else {}
        return Validation(summarize(rows, self.prompts, ev.n_samples), tables)

    def _write_generations(self, step: int, rows: list[dict]) -> list[list]:
        """The first `eval.log_generations` prompts' rows of `GENERATION_COLUMNS`, appended to
        val_generations.jsonl."""
        first = sorted((r for r in rows if r["index"] < self.cfg.eval.log_generations), key=lambda r: r["index"])
        generations = [[step, self.prompts[r["index"]].data_source, self.prompts[r["index"]].prompt_id,
                        self.prompts[r["index"]].text, r["texts"][0], self.prompts[r["index"]].answer,
                        r["rewards"][0]] for r in first]
        if generations:
            with (self.out_dir / "val_generations.jsonl").open("a", encoding="utf-8") as fh:
                for row in generations:
                    fh.write(json.dumps(dict(zip(GENERATION_COLUMNS, row))) + "\n")
        return generations
