"""`flexfloor demo`: the built-in example, vanilla against FlexFloor on 4 CPU ranks.

A tiny Qwen3-MoE (2 layers, 8 experts) replays a DeepScaleR-like length-tailed batch twice in one
gloo world: `vanilla` (verl-style: nobody leaves the EP group) and `planned` residency with floor 1
and TailGuard. It prints both rank-time ledgers, the dummy run removed, and checks that both produced
identical responses; `--json OUT` writes both reports (`{"vanilla": ..., "planned": ...}`, each as
`flexfloor rollout --json` writes its one), `--plot DIR` draws both rollouts' per-rank timelines.
"""
from __future__ import annotations

from megatron_rl.cli.rollout import add_rollout_args


def register(sub) -> None:
    p = sub.add_parser("demo", help="the built-in example: vanilla vs FlexFloor on 4 CPU ranks",
                       description=__doc__)
    add_rollout_args(p, default_config=None, one_run=False)
