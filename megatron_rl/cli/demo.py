"""`flexfloor demo`: the tiny MoE on 4 CPU ranks over gloo, a length-tailed batch, the ledger."""
from __future__ import annotations


def run(args) -> int:
    from megatron_rl.cli.rollout import run as run_rollout

    print("FlexFloor demo: a 2-layer, 8-expert Qwen3-MoE on 4 gloo ranks, replaying a "
          "DeepScaleR-like length-tailed batch (vanilla: nobody leaves the EP group).")
    return run_rollout(args)


def register(sub) -> None:
    p = sub.add_parser("demo", help="the built-in example: a tiny MoE rollout on 4 CPU ranks",
                       description=__doc__)
    from megatron_rl.cli.rollout import add_rollout_args

    add_rollout_args(p, default_config=None)
    p.set_defaults(func=run)
