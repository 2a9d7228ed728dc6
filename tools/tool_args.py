"""The flags several tools share, each group spelled once so that a flag means the same in every
tool: the Qwen3-MoE model a bench builds, the decode workload it times, the synthetic length trace
it replays, and the problem set a `make_*` tool writes. Each tool passes its own defaults (a tiny
CPU model, a 30B-shaped GPU one).

    from tools.tool_args import add_decode_args, add_model_args, add_problem_set_args, add_trace_args
"""
from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser, *, layers: int, hidden: int, experts: int, topk: int,
                   vocab: int) -> None:
    """--layers --hidden --experts --topk --vocab: the shape of the Qwen3-MoE model benchmarked."""
    p.add_argument("--layers", type=int, default=layers, help="MoE layers (Qwen3-30B-A3B has 48)")
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--experts", type=int, default=experts, help="experts per MoE layer")
    p.add_argument("--topk", type=int, default=topk, help="experts per token")
    p.add_argument("--vocab", type=int, default=vocab)


def add_decode_args(p: argparse.ArgumentParser, *, batch: int, prompt_len: int, new_tokens: int) -> None:
    """--batch --prompt-len --new-tokens: the greedy decode a bench times."""
    p.add_argument("--batch", type=int, default=batch, help="requests decoded together (per rank)")
    p.add_argument("--prompt-len", type=int, default=prompt_len)
    p.add_argument("--new-tokens", type=int, default=new_tokens, help="new tokens per request")


def add_trace_args(p: argparse.ArgumentParser, *, prompts: int, samples: int) -> None:
    """--prompts --samples: the size of the synthetic length trace's epochs (elastic/sim/synth.py)."""
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per epoch")
    p.add_argument("--samples", type=int, default=samples, help="GRPO group size")


def add_problem_set_args(p: argparse.ArgumentParser, *, n: int) -> None:
    """--out --n --seed: where a synthetic task's JSONL goes, how many problems, drawn with which seed."""
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--n", type=int, default=n, help="number of distinct problems")
    p.add_argument("--seed", type=int, default=0)
