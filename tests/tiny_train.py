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
    """`RolloutPhase.plan` with the ladder of stages down to one rank even where the offline plan
    keeps every rank (`adaptive` then takes the vanilla path, with no online rule): for tests of
    what the online rule does (moves, shrinks), not of when it pays."""
    from elastic.planning.replan import ladder_plan

    def plan(*args, **kwargs):
        p = plan_fn(*args, **kwargs)
        return p if len(p.stages) > 1 else ladder_plan(p, 1)
    return plan
