"""SFT warm start: teacher-forced cross-entropy on (prompt, reference answer + EOS).

RL from a random policy gets no reward signal (a group whose rewards are all equal has zero
advantage); a few supervised steps give a policy that sometimes succeeds. Same expert-parallel
layout and gradient rules as the GRPO update (`train_step`); its own AdamW, dropped afterwards.
Prompts come from a separate seeded iterator (seed + 1) so the warm start never shifts the RL
data order. A stop signal during it saves a checkpoint that the requeued run continues.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.trace import Trace
from megatron_rl.data.iterator import PromptIterator
from megatron_rl.data.prompts import PromptDataset, load_prompts
from megatron_rl.data.tokenizer import Tokenizer, build_tokenizer
from megatron_rl.files.out_lock import hold_out_dir
from megatron_rl.files.owned_paths import check_export_target
from megatron_rl.parallel.device import resolve_device
from megatron_rl.parallel.launch import run_ranks
from megatron_rl.rl.checkpoint.dcp import load_checkpoint, read_trainer_state, save_checkpoint
from megatron_rl.rl.model_setup import check_init, export_hf
from megatron_rl.rl.update.train_step import chunks, optimizer_step, pack, sequence_logprobs, training_optimizer
from megatron_rl.trainer_config import TrainerConfig


@dataclass
class WarmStart:
    """What a warm start did: the loss of each step it ran, and the step a stop signal saved and
    ended it at (None: it ran to the end)."""

    losses: list[float]
    stopped_at: int | None = None


def sft_warmstart(cfg: TrainerConfig, model, tok: Tokenizer, data: PromptDataset, rank: int,
                  world: int, stop=None, out_dir: str | Path | None = None,
                  resume: Path | None = None) -> WarmStart:
    """Run `cfg.warmstart.sft_steps` steps in place on `model`.

    Resumable: with `stop` (a `StopOnSignal`, polled after every step, a collective) and
    `out_dir`, a stop signal saves the warm start's weights, optimizer and data position as
    `out_dir`'s checkpoint of step 0 (`trainer_state.json` has `sft_step`), and the function
    returns at once (`stopped_at` is then the step); `resume` continues such a checkpoint from the
    step after it, bit-identically (its data order is keyed by seed + 1)."""
    ws = cfg.warmstart
    if ws.path is not None:
        data = load_prompts(replace(cfg.data, path=ws.path))
    usable = [p for p in data.prompts if p.answer is not None]
    if not usable:
        return WarmStart([])
    optimizer = training_optimizer(model, cfg.optim, rank, world, lr=ws.lr)
    it = PromptIterator(len(usable), min(ws.prompts_per_step, len(usable) - len(usable) % world),
                        seed=cfg.seed + 1)
    first = 1
    if resume is not None:
        state, _ = read_trainer_state(resume, cfg.model)
        load_checkpoint(resume, model, optimizer, None)
        it.load_state_dict(state["sft_data"], source=str(resume / "trainer_state.json"))
        first = state["sft_step"] + 1
    done, t0 = WarmStart([]), time.perf_counter()
    for step in range(first, ws.sft_steps + 1):
        rows = [(tok.encode_prompt(usable[i]), tok.encode_response(usable[i].answer))
                for i in it.next_batch().indices]
        done.losses.append(_sft_step(cfg, model, optimizer, rows, tok.pad_id, rank, world))
        if rank == 0 and (step % 20 == 0 or step == ws.sft_steps):
            print(f"[warmstart] step {step}/{ws.sft_steps} loss {done.losses[-1]:.4f} "
                  f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
        if stop is not None and stop.requested():  # polled on the last step too: no signal is lost
            _save_stopped(cfg, model, optimizer, it, step, out_dir, rank, world)
            done.stopped_at = step
            break
    if hasattr(optimizer, "close"):
        optimizer.close()  # else its hooks would take the gradients of the next optimizer's steps
    return done


def _sft_step(cfg: TrainerConfig, model, optimizer, rows: list, pad_id: int, rank: int, world: int) -> float:
    """One optimizer step of teacher-forced cross-entropy on `rows` ((prompt ids, response ids),
    split evenly over the ranks); returns the loss, summed over the ranks."""
    per_rank = len(rows) // world
    tokens = sum(len(r) for _, r in rows[: per_rank * world])
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64, device=model.device)
    for micro in chunks(rows[rank * per_rank : (rank + 1) * per_rank], cfg.grpo.micro_batch):
        packed = pack(micro, pad_id).to(model.device)
        logp = sequence_logprobs(model, packed, chunk_tokens=cfg.logprob_chunk_tokens)
        loss = -(logp * packed.loss_mask).sum() / tokens
        loss.backward()
        total += loss.detach().double()
    if world > 1:
        dist.all_reduce(total)
    optimizer_step(optimizer, model, cfg.optim.grad_clip, world)
    return float(total)


def _save_stopped(cfg: TrainerConfig, model, optimizer, it: PromptIterator, step: int, out_dir, rank: int,
                  world: int) -> None:
    """The warm start stopped after `step`: its weights, optimizer and data position as `out_dir`'s
    checkpoint of step 0 (`trainer_state.json` has `sft_step`)."""
    state = {"sft_step": step, "sft_data": it.state_dict(), "seed": cfg.seed, "model": cfg.model.to_dict(),
             "ranks": world}
    save_checkpoint(out_dir, 0, model, optimizer, None, state, Trace([], "length history"), rank)
    if rank == 0:
        print(f"[warmstart] stopped after step {step}/{cfg.warmstart.sft_steps}; checkpoint saved",
              file=sys.stderr, flush=True)


def sft_pending(state: dict) -> bool:
    """A checkpoint's trainer state is a stopped warm start's (continue it before step 1)."""
    return "sft_step" in state


def _sft_rank(ctx, cfg: TrainerConfig, backend, data: PromptDataset, out_dir: str):
    model = backend.training_model(cfg, ctx.rank, ctx.world, ctx.device)
    warm = sft_warmstart(cfg, model, build_tokenizer(cfg.tokenizer), data, ctx.rank, ctx.world)
    export_hf(model, cfg.model, out_dir, ctx.rank, ctx.world)
    return warm.losses


def run_warmstart(cfg: TrainerConfig, backend, out_dir: str) -> list[float]:
    """SFT-only run on `cfg.ranks` ranks with the run's `backend` (`megatron_rl.backends.backend`);
    writes a HuggingFace checkpoint usable as `init:`. The export replaces `out_dir` only where
    `flexfloor export --to` may (owned_paths.check_export_target)."""
    other_run = check_export_target(out_dir, None, "--out")
    device = resolve_device(cfg.device)
    check_init(cfg)
    data = load_prompts(cfg.data)
    with hold_out_dir(other_run, "sft_warmstart") if other_run else contextlib.nullcontext():
        return run_ranks(_sft_rank, cfg.ranks, cfg, backend, data, out_dir, timeout_s=cfg.timeout_s, device=device,
                         writes_to=out_dir)
