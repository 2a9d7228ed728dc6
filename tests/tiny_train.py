"""The smallest `flexfloor train` setup that still learns (a config file and its arithmetic data), and
the plan hook tests of the online rule use."""
from pathlib import Path

import yaml

TINY_TRAIN = {
    "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
              "kv_channels": 8, "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
              "vocab_size": 20},
    "grpo": {"group_size": 4, "micro_batch": 8}, "generation": {"max_response_len": 3},
    "checkpoint": {"every": 0, "export_hf": False}, "prompts_per_step": 4, "ranks": 2,
}


def tiny_train_config(folder: Path, **top) -> Path:
    """Write folder/data.jsonl and folder/cfg.yaml (TINY_TRAIN with `top` replacing top-level keys)."""
    from megatron_rl.data.arith import make_problems, write_jsonl

    write_jsonl(make_problems(20, seed=0, max_operand=4, ops="+"), folder / "data.jsonl")
    cfg = folder / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**TINY_TRAIN, "data": {"path": str(folder / "data.jsonl")}, **top}))
    return cfg


def laddered(plan_fn):
    """`RolloutPlanner.plan` with the ladder of stages down to one rank even where the offline plan
    keeps every rank (`adaptive` then takes the vanilla path, with no online rule): for tests of
    what the online rule does (moves, shrinks), not of when it pays."""
    from elastic.planning.online.ladder import ladder_plan

    def plan(*args, **kwargs):
        p = plan_fn(*args, **kwargs)
        return p if len(p.stages) > 1 else ladder_plan(p, 1)
    return plan


def tiny_run_folder(folder: Path, steps=(1, 2)) -> Path:
    """folder/out as `flexfloor train` leaves it after checkpoints of `steps` (TINY_TRAIN's model
    on one rank, no training): a run folder to export or resume, without running the ranks.
    Needs a one-rank process group (the `one_rank_group` fixture)."""
    import json

    from elastic.trace import Trace
    from megatron_rl.backends import backend
    from megatron_rl.data.iterator import PromptIterator
    from megatron_rl.files.out_lock import LOCK_NAME
    from megatron_rl.models.config import MoEModelConfig
    from megatron_rl.rl.checkpoint.dcp import save_checkpoint
    from megatron_rl.rl.update.train_step import make_optimizer
    from megatron_rl.trainer_config import TrainerConfig

    cfg = TrainerConfig(model=MoEModelConfig(**TINY_TRAIN["model"]), ranks=1, prompts_per_step=1)
    model = backend(cfg.backend).training_model(cfg, 0, 1)
    opt = make_optimizer(model, 1e-2)
    out = folder / "out"
    for step in steps:
        # The data position of `tiny_train_config`'s run (20 prompts, 4 a step) after `step` steps.
        data = PromptIterator(20, TINY_TRAIN["prompts_per_step"], seed=0)
        for _ in range(step):
            data.next_batch()
        state = {"data": data.state_dict(), "seed": 0, "model": cfg.model.to_dict(), "ranks": 1}
        save_checkpoint(out, step, model, opt, None, state, Trace([], "h"), 0)
    (out / LOCK_NAME).write_text("")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))
    return out


def rehash(step_dir: Path, *names: str) -> None:
    """Re-sign files of a checkpoint a test changed on purpose, so that what it checks is the
    change itself, not the checksum (checksums.json covers the shards and the sidecars)."""
    import hashlib
    import json

    sums = json.loads((step_dir / "checksums.json").read_text())
    for n in names:
        sums[n] = hashlib.sha256((step_dir / n).read_bytes()).hexdigest()
    (step_dir / "checksums.json").write_text(json.dumps(sums))
