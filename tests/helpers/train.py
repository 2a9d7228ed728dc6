"""Training runs the tests compare: `flexfloor train` in a subprocess and its metrics, the tiny MoE
trainer configs, and one rank's runs of several policies (tests/tiny_train.py: the smallest config
file and its data)."""
import json
import os
from pathlib import Path

from tests.helpers.cli import cli

# The 2-layer, 8-expert model of the in-process trainer configs (vocab_size is the caller's).
TINY_MOE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16)


def train(config, out, *extra, expect: int | None = 0, env: dict | None = None):
    """`flexfloor train --config CONFIG --out OUT EXTRA...` to its end; `expect`: the exit status it
    must have (None: any)."""
    return cli("train", "--config", config, "--out", out, *extra, expect=expect, env=env)


def metrics(out) -> list[dict]:
    """The rows of a run's metrics.jsonl, one a step."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def trainer_config(vocab_size: int = 24, **fields):
    """A TrainerConfig of TINY_MOE with `fields` (grpo, optim, ranks, ...) set."""
    from megatron_rl.models.config import MoEModelConfig
    from megatron_rl.trainer_config import TrainerConfig

    return TrainerConfig(model=MoEModelConfig(**TINY_MOE, vocab_size=vocab_size), **fields)


def each_policy(ctx, out: str, configs: dict, measure) -> None:
    """On this rank (`run_ranks`): a Trainer per policy's config, in out/<policy>, handed to
    `measure(policy, trainer) -> dict` (which steps it, `trainer_step`); the dicts go to out/rank<r>.json."""
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.trainer import build_trainer

    results = {}
    for policy, cfg in configs.items():
        results[policy] = measure(policy, build_trainer(cfg, load_prompts(cfg.data), ctx, os.path.join(out, policy),
                                                        None))
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(results, f)


def trainer_step(trainer, n: int) -> dict:
    """Trainer step `n`'s metrics, as the run loop steps it."""
    from megatron_rl.rl.step_faults import StepPhases

    return trainer.step(n, StepPhases("rollout")).metrics


def rank_results(out, world: int) -> list[dict]:
    """What `each_policy` wrote on each of `world` ranks."""
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


def weights(trainer) -> list[float]:
    """The trainer's parameters as one flat list (compared bitwise in float64)."""
    import torch

    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]).tolist()


# The metrics training sees (timings and the ledger are measurements and differ run to run).
LEARNING = ("reward/", "response_length/", "actor/", "training/")


def learning(row: dict, prefixes: tuple = LEARNING) -> dict:
    """A metrics row's keys under `prefixes`: what two runs that train alike must share exactly."""
    return {k: v for k, v in row.items() if k.startswith(prefixes)}
