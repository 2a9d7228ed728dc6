"""What `train`'s driver checks of the run's inputs before any rank starts: the training prompts,
the held-out prompts (`eval.path`), the warm start's prompts and the reward function. Each of these
would otherwise fail inside every rank, after the model is built; here a bad row stops the run in
one line naming it (file:line).
"""
from __future__ import annotations

import sys

from megatron_rl.data.chat_template import check_chat_template
from megatron_rl.data.prompts import PromptDataset, load_prompts
from megatron_rl.data.tokenizer import Tokenizer, build_tokenizer
from megatron_rl.errors import FlexFloorError
from megatron_rl.rewards import check_reward_file
from megatron_rl.rl.validation import load_heldout
from megatron_rl.trainer_config import TrainerConfig


def checked_inputs(cfg: TrainerConfig) -> tuple[PromptDataset, Tokenizer]:
    """The training prompts and the tokenizer, once every input the ranks will read has passed."""
    data = load_prompts(cfg.data)
    if data.skipped:
        print(f"[train] {cfg.data.path}: skipped {data.skipped} bad rows (first: "
              f"{data.skipped_rows[0][1]})", file=sys.stderr)
    tok = build_tokenizer(cfg.tokenizer)
    check_data(cfg, data, tok)
    if cfg.eval.every:  # a bad held-out file stops here, naming file:line, as the training data does
        heldout = load_heldout(cfg)
        where = ", ".join(cfg.eval.paths)
        if not heldout:
            raise FlexFloorError(f"{where}: no held-out prompts (eval.path)")
        check_prompts(cfg, heldout, where, tok)
    if cfg.warmstart.sft_steps:
        check_warmstart(cfg, data, tok)
    check_reward_file(cfg.reward)  # a custom reward file that does not load stops here, before the ranks
    return data, tok


def check_data(cfg: TrainerConfig, data: PromptDataset, tok) -> None:
    """What would otherwise fail only after the ranks start: a step needs more prompts than the
    dataset has, a prompt the tokenizer cannot encode, or one that leaves no room for a response
    within the model's positions. Errors name the row (file:line)."""
    if len(data) < cfg.prompts_per_step:
        raise FlexFloorError(f"{cfg.data.path}: {len(data)} usable prompts, fewer than one step's "
                             f"prompts_per_step ({cfg.prompts_per_step})")
    launched = cfg.partial.groups_launched(cfg.prompts_per_step)
    if len(data) < launched:  # the same prompt would be launched twice in one rollout
        raise FlexFloorError(f"{cfg.data.path}: {len(data)} usable prompts, fewer than the {launched} groups "
                             f"a partial rollout launches (prompts_per_step {cfg.prompts_per_step} x "
                             f"(1 + partial.over_sample {cfg.partial.over_sample:g}))")
    check_prompts(cfg, data.prompts, cfg.data.path, tok)


def check_prompts(cfg: TrainerConfig, prompts: list, path: str, tok) -> None:
    """The rows of `path` (the training data, or the held-out prompts of `eval.path`) each rank
    will encode and generate from: a reference answer to score against, text the tokenizer can
    encode, room for a response within the model's positions."""
    # Both reward kinds compare with a reference answer: without any, every response would score
    # `no_reference` (reward 0) and the run would train (or validate) on nothing.
    if not any(p.answer is not None and str(p.answer).strip() for p in prompts):
        raise FlexFloorError(f"{path}: no row has a reference answer (data.answer_field "
                             f"{cfg.data.answer_field or 'answer'!r}), which reward kind {cfg.reward.kind!r} compares "
                             "responses with; set data.answer_field to the field that holds it")
    check_chat_template(tok, prompts, cfg.model.max_position_embeddings)  # the first rows, bounded
    room = cfg.model.max_position_embeddings - cfg.generation.max_response_len
    for p in prompts:
        try:
            n = len(tok.encode_prompt(p))
        except FlexFloorError as e:
            raise FlexFloorError(f"{p.where}: {e}") from None
        if n > room:
            raise FlexFloorError(f"{p.where}: prompt of {n} tokens + generation.max_response_len "
                                 f"{cfg.generation.max_response_len} exceeds model.max_position_embeddings "
                                 f"({cfg.model.max_position_embeddings})")


def check_warmstart(cfg: TrainerConfig, data: PromptDataset, tok) -> None:
    """The SFT warm start's prompts (`warmstart.path`, else the training data), checked alike, and
    enough of them with an answer for every rank to learn from one."""
    from dataclasses import replace

    path = cfg.warmstart.path or cfg.data.path
    if cfg.warmstart.path:
        data = load_prompts(replace(cfg.data, path=path))
        check_prompts(cfg, data.prompts, path, tok)
    usable = sum(p.answer is not None for p in data.prompts)
    if usable < cfg.ranks:
        raise FlexFloorError(f"{path}: {usable} prompts with an answer to learn from, fewer than the "
                             f"{cfg.ranks} ranks the warm start (warmstart.sft_steps) spreads them over")
