"""Synchronous GRPO post-training of a Qwen3-MoE on W ranks: the loop, one step at a time.

    rollout   -> the elastic rollout phase generates G responses per prompt (rl/rollout_phase.py)
    reward    -> each rank scores its share of the responses (rewards/)
    advantage -> group-normalised advantages (rl/grpo.py)
    logprobs  -> old-policy (and reference) log-probs recomputed under training numerics
    update    -> clipped policy-gradient loss, dense grads all-reduced, experts' kept by their
                 owners, global-norm clipping, AdamW step (rl/update.py)
    sync      -> the replicas agree; the rollout model *is* the trained model, so the next rollout
                 uses the new weights with no copy

The same model object hosts generation and training. Everything after the rollout reads responses in
canonical order, so the rollout policy (vanilla or planned) changes nothing training sees.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.trace import Trace
from megatron_rl.backends import backend
from megatron_rl.config import write_config
from megatron_rl.data.iterator import PromptIterator
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.data.tokenizer import build_tokenizer
from megatron_rl.errors import FlexFloorError
from megatron_rl.metrics import MetricsLogger, gpu_memory, length_stats, require_matplotlib
from megatron_rl.parallel.signals import StopOnSignal
from megatron_rl.provenance import provenance
from megatron_rl.rewards import OUTCOMES, Scorer, Verdict, mean_extras
from megatron_rl.rl.async_save import CheckpointWriter
from megatron_rl.rl.checkpoint import (
    CheckpointError,
    load_checkpoint,
    point_latest,
    read_trainer_state,
    vet_checkpoint,
)
from megatron_rl.rl.checkpoint_retention import check_room
from megatron_rl.rl.deadline import run_deadline, stopped_summary
from megatron_rl.rl.grpo import group_advantages
from megatron_rl.rl.leases import TrainingLeases
from megatron_rl.rl.mixed_precision import training_state_bytes
from megatron_rl.rl.model_setup import check_init, export_hf
from megatron_rl.rl.partial import PartialRollouts
from megatron_rl.rl.resume_fit import check_resume_fit
from megatron_rl.rl.rollout_phase import RolloutPhase, history_records, step_seed
from megatron_rl.rl.sft import sft_pending, sft_stopped, sft_warmstart
from megatron_rl.rl.train_step import check_replicas, frozen_copy
from megatron_rl.rl.update import PolicyUpdate
from megatron_rl.rl.validation import Validator, load_heldout
from megatron_rl.trainer_config import TrainerConfig
from megatron_rl.verl_metrics import device_peak_flops, verl_figures
from megatron_rl.wandb_run import policy_tags


class Trainer:
    def __init__(self, cfg: TrainerConfig, data: PromptDataset, ctx, out_dir: str | Path,
                 resume: Path | None):
        """`ctx`: this rank's `megatron_rl.parallel.launch.ParallelContext`."""
        self.cfg, self.data, self.rank, self.world = cfg, data, ctx.rank, ctx.world
        rank, world = ctx.rank, ctx.world
        self.out_dir = Path(out_dir)
        self.tok = build_tokenizer(cfg.tokenizer)
        self.backend = backend(cfg.backend)  # built once here, handed down to the rollout phase
        self.model = self.backend.training_model(cfg, rank, world, ctx.device)
        self.iterator = PromptIterator(len(data), cfg.prompts_per_step, cfg.seed)
        self.history = Trace([], "length history")
        # Partial rollouts (off by default): groups carried between steps (rl/partial.py).
        self.partial = PartialRollouts(cfg, data, self.iterator, self.tok) if cfg.partial.enabled else None
        self.start_step = 0
        state = read_trainer_state(resume, cfg.model)[0] if resume is not None else None
        self.sft_stopped = None  # the warm-start step a stop signal saved, if one did
        if cfg.warmstart.sft_steps and (resume is None or sft_pending(state)):
            with StopOnSignal(ctx.device) as stop:
                losses = sft_warmstart(cfg, self.model, self.tok, data, rank, world, stop, self.out_dir,
                                       resume=resume)
            self.sft_stopped = sft_stopped(losses) and (sft_stopped(losses), stop.signum)
            resume = None  # the RL run starts at step 1 from the warm-started weights
        self.ref_model = frozen_copy(self.model) if cfg.grpo.kl_coef > 0 else None
        self.optimizer = self.backend.optimizer(self.model, cfg, rank, world)
        if resume is not None:
            state, self.history = read_trainer_state(resume, cfg.model)
            load_checkpoint(resume, self.model, self.optimizer, self.ref_model,
                            cfg.checkpoint.allow_unverified)
            self.iterator.load_state_dict(state["data"])
            if self.partial is not None and "partial" in state:
                self.partial.load_state_dict(state["partial"], source=str(resume / "trainer_state.json"))
            self.start_step = state["step"]
        self.scorer = Scorer(cfg.reward)
        self.peak_flops = device_peak_flops(ctx.device)
        self.validator = Validator(cfg, self.out_dir) if cfg.eval.every else None
        self.rollout = RolloutPhase(cfg, self.backend, self.model, self.tok, rank, world, ctx.store,
                                    resident_bytes=training_state_bytes(self.model, self.optimizer,
                                                                        self.ref_model, world),
                                    leases=TrainingLeases(cfg, self.tok, rank, world), out_dir=self.out_dir)
        self.update = PolicyUpdate(cfg, self.model, self.optimizer, self.ref_model, self.tok.pad_id,
                                   rank, world)
        self.deadline = run_deadline(cfg.end_by, rank)  # the job's end: stop and save before it
        self.saver = CheckpointWriter(cfg.checkpoint.async_save, self.deadline and self.deadline.after_save)
        self.logger = None
        if rank == 0:
            self.logger = MetricsLogger(self.out_dir, cfg.logging,
                                        run_config={**asdict(cfg), "moe": self.backend.describe(),
                                                    "provenance": provenance()},
                                        resume_step=self.start_step if resume is not None else None,
                                        tags=policy_tags(cfg.elastic.policy, cfg.elastic.floor))

    # ---- one step -------------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        cfg, G = self.cfg, self.cfg.grpo.group_size
        torch.manual_seed(step_seed(cfg.seed, step))
        times: dict[str, float] = {}
        self.phase = "rollout"
        t = t_step = time.perf_counter()
        if self.partial is None:
            batch = self.iterator.next_batch()
            prompts = [self.data[i] for i in batch.indices]
            rollout = self.rollout.run(step, prompts, self.history)
            epoch, records, partial = batch.epoch, history_records(rollout, batch.epoch), {}
        else:
            prompts, rollout, records, partial = self.partial.step(step, self.rollout, self.history)
            epoch = self.iterator.epoch
        self.timeline = rollout.timeline
        t = self._lap(times, "rollout", t)

        rewards, counts, extras = self.score(prompts, rollout.responses, rollout.scored)
        advantages = group_advantages(rewards, G, cfg.grpo.std_normalize)
        t = self._lap(times, "reward", t)

        batches = self.update.minibatches(rollout.responses, advantages)
        self.update.recompute_logprobs(batches)
        t = self._lap(times, "logprob", t)

        stats = self.update.update(batches)
        self.optimizer.zero_grad(set_to_none=True)  # the rollout's KV gets the gradients' memory
        t = self._lap(times, "update", t)

        if cfg.verify_replicas:
            check_replicas(self.model, self.world)
        self.history = Trace(self.history.records + records, "length history")
        self._lap(times, "sync", t)

        lengths = [len(r.tokens) for r in rollout.responses]
        step_s = time.perf_counter() - t_step
        prompt_lens = [len(self.tok.encode_prompt(prompts[i // G])) for i in range(len(lengths))]
        return {
            "epoch": epoch,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "reward_outcomes": counts,
            **({"reward_extra": extras} if extras else {}),
            **verl_figures(step, advantages.cpu(), prompt_lens, lengths, times, step_s, self.world,
                           cfg.model, self.peak_flops),
            **length_stats(lengths, [r.truncated for r in rollout.responses]),
            **rollout.ledger,
            "stages": rollout.stages,
            "layout": rollout.layout,
            "placement": rollout.placement,
            "phase_s": times,
            "step_s": step_s,
            "lease": rollout.lease,
            **({"partial": partial} if partial else {}),
            "tokens_per_s": sum(lengths) / max(times["rollout"], 1e-9),
            "lr": self.optimizer.param_groups[0]["lr"],
            **stats,
            **gpu_memory(),
        }

    def score(self, prompts, responses, scored: dict[int, Verdict]) -> tuple[torch.Tensor, dict, dict]:
        """Each rank scores its share of what no lease scored (`scored`: index -> verdict, the same
        on every rank; rank 0 credits those); rewards and outcome counts are summed over ranks, a
        custom function's extra keys averaged over the responses that returned them."""
        G, n = self.cfg.grpo.group_size, len(responses)
        rewards = torch.zeros(n, dtype=torch.float64)
        for i in [i for i in range(n) if i not in scored][self.rank::self.world]:
            text = self.tok.decode(responses[i].tokens)
            rewards[i] = self.scorer.credit(self.scorer.judge(text, prompts[i // G]))
        for i, verdict in scored.items() if self.rank == 0 else ():
            rewards[i] = self.scorer.credit(verdict)
        extras = mean_extras(self.scorer.take_extras(), self.world) if self.cfg.reward.kind == "custom" else {}
        counts_local = self.scorer.take_counts()
        counts = torch.tensor([counts_local[k] for k in OUTCOMES], dtype=torch.float64)
        if self.world > 1:  # on the model's device: NCCL reduces GPU tensors only
            rewards, counts = rewards.to(self.model.device), counts.to(self.model.device)
            dist.all_reduce(rewards)
            dist.all_reduce(counts)
        return rewards, {k: int(c) for k, c in zip(OUTCOMES, counts)}, extras

    def _lap(self, times: dict, name: str, t: float) -> float:
        """Record phase `name`'s time; the next phase starts (named in a fault's message)."""
        now = time.perf_counter()
        times[name] = now - t
        self.phase = _NEXT_PHASE.get(name, name)
        return now

    def _timeline_media(self, step: int) -> dict:
        """Every `logging.plot_every` steps: the step's rollout timeline, drawn to
        OUT/timelines/step<N>.png, and its segments, for the metrics logger."""
        every = self.cfg.logging.plot_every
        if not every or step % every:
            return {}
        from elastic.timeline_plot import plot_timelines

        tl = self.timeline
        tl.title = f"step {step}: {self.cfg.elastic.policy}"
        path = plot_timelines([tl], self.out_dir / "timelines" / f"step{step:06d}.png")
        return {"images": {"rollout_timeline": path}, "tables": {"rollout/timeline": (tl.columns(), tl.rows())}}

    # ---- the run --------------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        state = {"data": self.iterator.state_dict(), "seed": self.cfg.seed,
                 "model": self.cfg.model.to_dict(), "ranks": self.world, "provenance": provenance()}
        if self.partial is not None:  # the carried responses, so a resume continues them
            state["partial"] = self.partial.state_dict()
        return state

    def validate(self, step: int) -> dict:
        """`val` and `val_core` metrics on rank 0 ({} elsewhere): a collective."""
        return self.validator.run(self.model, self.tok, self.rank, self.world, step)

    def _log_validation(self, step: int, val: dict, t0: float) -> None:
        print(f"[train] step {step}/{self.cfg.steps} held-out pass@1 {val['pass@1']:.3f} reward "
              f"{val['reward_mean']:.3f} len {val['response_len_mean']:.2f} ({val['prompts']} prompts, "
              f"{time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)

    def run(self) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        curve, stopped, val_curve = [], None, []
        if self.validator is not None and self.start_step == 0 and not self.sft_stopped:
            val = self.validate(0)  # the warm start's figure, before any RL update
            if self.logger is not None:
                val_curve.append((0, val["val"]["pass@1"]))
                self.logger.log(0, val, tables=self.validator.tables())
                self._log_validation(0, val["val"], t0)
        if self.sft_stopped:  # the warm start was stopped and saved: the requeue continues it
            if self.logger is not None:
                self.logger.close()
            step, signum = self.sft_stopped
            return {"start_step": 0, "steps": cfg.steps, "reward_curve": [], "wall_s": 0.0,
                    "stopped": {"step": 0, "sft_step": step, "signal": signal.Signals(signum).name}}
        try:
            with StopOnSignal(next(self.model.parameters()).device) as stop:
                for step in range(self.start_step + 1, cfg.steps + 1):
                    t_step = time.perf_counter()
                    with step_faults(self, step):
                        metrics = self.step(step)
                    check_finite(step, metrics, self.out_dir)
                    if self.validator is not None and step % cfg.eval.every == 0:
                        metrics.update(self.validate(step))
                        if "val" in metrics:
                            val_curve.append((step, metrics["val"]["pass@1"]))
                    curve.append(metrics["reward_mean"])
                    if self.logger is not None:
                        media = self._timeline_media(step)
                        if "val" in metrics:
                            media["tables"] = {**media.get("tables", {}), **self.validator.tables()}
                        self.logger.log(step, metrics, **media)
                        print(f"[train] step {step}/{cfg.steps} reward {metrics['reward_mean']:.3f} "
                              f"len {metrics['response_len_mean']:.1f} loss {metrics['loss']:+.4f} "
                              f"grad {metrics['grad_norm']:.3f} dummy {metrics['dummy_share']:.1%} "
                              f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
                        if "val" in metrics:
                            self._log_validation(step, metrics["val"], t0)
                    # The last step needs no early stop: it is saved and exported anyway.
                    with step_faults(self, step, "stop-check"):
                        if self.deadline is not None:
                            self.deadline.after_step(time.perf_counter() - t_step)
                        late = self.deadline is not None and self.deadline.must_stop()
                        stopped = step if stop.requested(late) and step < cfg.steps else None
                    if step == cfg.steps or stopped or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                        with step_faults(self, step, "checkpoint"):
                            self.saver.save(self.out_dir, step, self.model, self.optimizer, self.ref_model,
                                            self.trainer_state(), self.history, self.rank,
                                            (cfg.checkpoint.keep_last, cfg.checkpoint.keep_every),
                                            last=step == cfg.steps or bool(stopped))
                    if stopped:
                        break
            if cfg.checkpoint.export_hf and not stopped:
                export_hf(self.model, cfg.model, self.out_dir / "hf", self.rank, self.world, self.tok)
        finally:
            self.saver.close()  # a failed step: the pending save still ends (it was a good step's)
            if self.logger is not None:
                self.logger.close()
        summary = {"start_step": self.start_step, "steps": cfg.steps, "reward_curve": curve,
                   "wall_s": time.perf_counter() - t0}
        if val_curve:
            summary["val_pass@1"] = val_curve
        if stopped:  # a requeue, pre-emption or the job's end: the next run with this --out resumes here
            summary["stopped"] = stopped_summary(stopped, stop, self.deadline, self.out_dir, self.rank)
        return summary


class TrainingDiverged(FlexFloorError):
    pass


_NEXT_PHASE = {"rollout": "reward", "reward": "logprob", "logprob": "update", "update": "sync"}
# What a collective that failed says (gloo, NCCL, the c10d store): a peer froze, died or timed out.
_COLLECTIVE = re.compile(r"[Tt]imed out|[Tt]imeout|Connection (closed|reset|refused)|NCCL|gloo|"
                         r"Broken pipe|peer|[Ss]ocket")


class StepFault(RuntimeError):
    """A collective failed in a training step: one line naming rank, step and phase (what the
    launcher prints), as the rollout's `ElasticFault` names rank, stage and phase."""

    one_line = True


@contextlib.contextmanager
def step_faults(trainer: Trainer, step: int, phase: str | None = None):
    """Turn a failed collective inside the block into a `StepFault`; bugs keep their traceback."""
    from elastic.runtime.runtime import ElasticFault, _short

    if phase is not None:
        trainer.phase = phase
    try:
        yield
    except ElasticFault as e:  # the rollout's own (rank, stage, phase); the step is what it lacks
        from megatron_rl.parallel.launch import user_error

        if user_error(e) is not None:  # a user's mistake travels as itself
            raise
        cause = str(e).split(": ", 1)[-1]
        raise StepFault(f"rank {e.rank}, step {step}, stage {e.stage}, phase {e.phase}: {cause}") from None
    except RuntimeError as e:
        if isinstance(e, StepFault) or not (isinstance(e, dist.DistError) or _COLLECTIVE.search(str(e))):
            raise
        raise StepFault(f"rank {trainer.rank}, step {step}, phase {trainer.phase}: {_short(e)} "
                        f"(timeout_s {trainer.cfg.timeout_s:g}; a peer rank froze, died or is slower)") from None


def check_finite(step: int, metrics: dict, out_dir: Path) -> None:
    """Stop on a non-finite loss or gradient norm (the same on every rank: both are global), before
    the step is saved, so the last checkpoint stays the last good one."""
    bad = [f"{k} {metrics[k]}" for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])]
    if bad:
        from megatron_rl.rl.checkpoint import latest_checkpoint

        last = latest_checkpoint(out_dir)
        raise TrainingDiverged(f"step {step}: non-finite {', '.join(bad)}; stopped without saving it "
                               f"(last good checkpoint: {last or 'none'})")


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

    from megatron_rl.data.prompts import load_prompts

    path = cfg.warmstart.path or cfg.data.path
    if cfg.warmstart.path:
        data = load_prompts(replace(cfg.data, path=path))
        check_prompts(cfg, data.prompts, path, tok)
    usable = sum(p.answer is not None for p in data.prompts)
    if usable < cfg.ranks:
        raise FlexFloorError(f"{path}: {usable} prompts with an answer to learn from, fewer than the "
                             f"{cfg.ranks} ranks the warm start (warmstart.sft_steps) spreads them over")


def _rank_main(ctx, cfg: TrainerConfig, data: PromptDataset, out_dir: str, resume: Path | None):
    return Trainer(cfg, data, ctx, out_dir, resume).run()


def run_training(cfg: TrainerConfig, out_dir: str | Path, *, preflight_done: bool = False,
                 resume_step: int | None = None) -> dict | None:
    """Check the inputs here (the preflight unless the caller ran it, dataset, resume point), then
    train on `cfg.ranks` ranks.

    Resumes from `out_dir`'s latest checkpoint when there is one (`resume_step`: from that step's).
    Returns rank 0's summary (None on non-zero torchrun ranks).
    """
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.parallel.device import resolve_device
    from megatron_rl.parallel.launch import driver_process, run_ranks
    from megatron_rl.preflight import preflight
    from megatron_rl.rl.checkpoint import checkpoint_at, latest_checkpoint

    if not preflight_done:
        preflight(cfg.backend, cfg.dtype, cfg.leases, cfg.optim.offload)
    if cfg.logging.plot_every:
        require_matplotlib("logging.plot_every")
    device = resolve_device(cfg.device)
    check_init(cfg)
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
    Scorer(cfg.reward)  # a custom reward file that does not load stops here, before the ranks
    if resume_step is not None:
        resume = checkpoint_at(out_dir, resume_step)
    else:
        resume = latest_checkpoint(out_dir)
    if resume is not None:
        vet_checkpoint(resume, cfg.checkpoint.allow_unverified)  # before any of it is parsed
        state, _ = read_trainer_state(resume, cfg.model)
        check_resume_fit(cfg, data, tok, resume, state)
        if state["step"] >= cfg.steps:
            done = f"{resume}: already at step {state['step']} of steps={cfg.steps}"
            hf = Path(out_dir) / "hf"
            if cfg.checkpoint.export_hf and not hf.exists():  # an export that failed at the end
                done += f" (a missing {hf}: `flexfloor export --out {out_dir}` writes it)"
            if int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
                # A requeue that came after the last step was saved: the job is done, not failed.
                print(f"[train] {done}; the requeued job has nothing left to train", file=sys.stderr)
                return None
            raise CheckpointError(f"{done}; raise `steps` to train further")
        print(f"[train] resuming from {resume} (step {state['step']})", file=sys.stderr)
        if resume_step is not None and driver_process():  # before metrics.jsonl loses the later steps
            point_latest(resume)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if driver_process():
        check_room(cfg, out_dir)  # a save that cannot fit is refused now, not half-way
        write_config(cfg, out_dir)
    return run_ranks(_rank_main, cfg.ranks, cfg, data, str(out_dir), resume, timeout_s=cfg.timeout_s,
                     stop_grace_s=cfg.checkpoint.stop_grace_s, device=device)
