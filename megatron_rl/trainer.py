"""Synchronous GRPO post-training of a Qwen3-MoE on W ranks: the loop, one step at a time.

    rollout   -> the elastic rollout phase generates G responses per prompt (rl/rollout_phase/phase.py)
    reward    -> each rank scores its share of the responses (rewards/)
    advantage -> group-normalised advantages (rl/update/grpo.py)
    logprobs  -> old-policy (and reference) log-probs recomputed under training numerics
    update    -> clipped policy-gradient loss, dense grads all-reduced, experts' kept by their
                 owners, global-norm clipping, AdamW step (rl/update/policy_update.py)
    sync      -> the replicas agree; the rollout model *is* the trained model, so the next rollout
                 uses the new weights with no copy

The same model object hosts generation and training. Everything after the rollout reads responses in
canonical order, so the rollout policy (vanilla or planned) changes nothing training sees.
`build_trainer` builds one rank's trainer from the config (the SFT warm start, the resume, the
wiring); `Trainer.run` is the loop. What is checked before any rank starts, and the launch, are the
driver's (train_driver.py).
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic.timeline import Timeline
from elastic.trace import Trace
from megatron_rl.backends import backend
from megatron_rl.data.iterator import PromptIterator
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.data.tokenizer import Tokenizer, build_tokenizer
from megatron_rl.metrics.logger import gpu_memory, length_stats
from megatron_rl.metrics.verl import device_peak_flops, verl_figures
from megatron_rl.parallel.signals import StopOnSignal
from megatron_rl.provenance import provenance
from megatron_rl.rewards import OUTCOMES, Scorer, Verdict, check_error_share, mean_extras
from megatron_rl.rl.checkpoint.async_save import CheckpointWriter
from megatron_rl.rl.checkpoint.dcp import load_checkpoint, read_trainer_state
from megatron_rl.rl.deadline import Deadline, run_deadline, stopped_summary
from megatron_rl.rl.model_setup import export_hf
from megatron_rl.rl.optim.mixed_precision import training_state_bytes
from megatron_rl.rl.rollout_phase.leases import TrainingLeases
from megatron_rl.rl.rollout_phase.partial import PartialRollouts
from megatron_rl.rl.rollout_phase.phase import RolloutPhase, history_records, step_seed
from megatron_rl.rl.run_log import RunLog
from megatron_rl.rl.sft import sft_pending, sft_warmstart
from megatron_rl.rl.step_faults import StepPhases, check_finite, step_faults
from megatron_rl.rl.update.grpo import group_advantages
from megatron_rl.rl.update.policy_update import PolicyUpdate
from megatron_rl.rl.update.train_step import check_replicas, frozen_copy
from megatron_rl.rl.validation import Validation, Validator
from megatron_rl.trainer_config import TrainerConfig


@dataclass
class RunStart:
    """Where a run's steps start: after the resumed checkpoint's step, with its length history (0
    and an empty history for a new run); `sft_stopped`: the run summary's `stopped` entry when a
    stop signal ended the warm start (saved as step 0: the run ends at once, its requeue continues)."""

    step: int
    history: Trace
    sft_stopped: dict | None = None


@dataclass
class StepReport:
    """One step's figures (a metrics row) and its rollout's per-rank timeline (drawn every
    `logging.plot_every` steps)."""

    metrics: dict
    timeline: Timeline


def build_trainer(cfg: TrainerConfig, data: PromptDataset, ctx, out_dir: str | Path,
                  resume: Path | None) -> Trainer:
    """This rank's trainer (`ctx`: its `megatron_rl.parallel.launch.ParallelContext`): the model and
    the SFT warm start (or the continuation of a stopped one's checkpoint), then the optimizer and
    the resume from `resume` (weights, optimizer, data position, carried groups, length history),
    and the phases wired over them. Collectives run in the same order on every rank."""
    rank, world, out_dir = ctx.rank, ctx.world, Path(out_dir)
    tok = build_tokenizer(cfg.tokenizer)
    be = backend(cfg.backend)  # built once here, handed down to the rollout phase
    model = be.training_model(cfg, rank, world, ctx.device)
    iterator = PromptIterator(len(data), cfg.prompts_per_step, cfg.seed)
    # Partial rollouts (off by default): groups carried between steps (rl/rollout_phase/partial.py).
    partial = PartialRollouts(cfg, data, iterator, tok) if cfg.partial.enabled else None
    sft_stopped = None
    if _warm_start_due(cfg, resume):
        with StopOnSignal(ctx.device) as stop:
            warm = sft_warmstart(cfg, model, tok, data, rank, world, stop, out_dir, resume=resume)
        if warm.stopped_at:
            sft_stopped = {"step": 0, "sft_step": warm.stopped_at, "signal": signal.Signals(stop.signum).name}
        resume = None  # the RL run starts at step 1 from the warm-started weights
    ref_model = frozen_copy(model) if cfg.grpo.kl_coef > 0 else None
    optimizer = be.optimizer(model, cfg, rank, world)
    if resume is not None:
        start = _resume(resume, cfg, model, optimizer, ref_model, iterator, partial)
    else:
        start = RunStart(0, Trace([], "length history"), sft_stopped)
    deadline = run_deadline(cfg.end_by, rank)  # the job's end: stop and save before it
    keep = (cfg.checkpoint.keep_last, cfg.checkpoint.keep_every)
    return Trainer(
        cfg=cfg, rank=rank, world=world, out_dir=out_dir, data=data, tok=tok, iterator=iterator,
        partial=partial, model=model, optimizer=optimizer, ref_model=ref_model,
        rollout=RolloutPhase.build(cfg, be, model, tok, ctx,
                                   resident_bytes=training_state_bytes(model, optimizer, ref_model, world),
                                   leases=TrainingLeases(cfg, tok, rank, world), out_dir=out_dir),
        scorer=Scorer(cfg.reward), update=PolicyUpdate(cfg, model, optimizer, ref_model, tok.pad_id, rank, world),
        peak_flops=device_peak_flops(ctx.device),
        validator=Validator(cfg, out_dir) if cfg.eval.every else None,
        saver=CheckpointWriter(cfg.checkpoint.async_save, out_dir, rank, keep, deadline and deadline.after_save),
        deadline=deadline,
        run_log=RunLog(cfg, out_dir, start.step if resume is not None else None, be.describe()) if rank == 0 else None,
        start=start, history=start.history)


def _warm_start_due(cfg: TrainerConfig, resume: Path | None) -> bool:
    """The config asks for a warm start and no checkpoint resumes the RL run: a new run, or one
    whose checkpoint is a stopped warm start's (continued first)."""
    if not cfg.warmstart.sft_steps:
        return False
    if resume is None:
        return True
    state, _ = read_trainer_state(resume, cfg.model)
    return sft_pending(state)


def _resume(resume: Path, cfg: TrainerConfig, model, optimizer, ref_model, iterator: PromptIterator,
            partial: PartialRollouts | None) -> RunStart:
    """Load checkpoint `resume` into the built model, optimizer, reference, data position and pool
    of carried groups."""
    state, history = read_trainer_state(resume, cfg.model)
    load_checkpoint(resume, model, optimizer, ref_model, cfg.checkpoint.allow_unverified)
    source = str(resume / "trainer_state.json")
    iterator.load_state_dict(state["data"], source=source)
    if partial is not None and "partial" in state:
        partial.load_state_dict(state["partial"], source=source)
    return RunStart(state["step"], history)


@dataclass(eq=False)
class Trainer:
    """One rank's GRPO run, as `build_trainer` wired it: `run` steps it to `cfg.steps`."""

    cfg: TrainerConfig
    rank: int
    world: int
    out_dir: Path
    # What a step reads and trains.
    data: PromptDataset
    tok: Tokenizer
    iterator: PromptIterator
    partial: PartialRollouts | None  # groups carried between steps (`partial.enabled`)
    model: torch.nn.Module
    optimizer: Any
    ref_model: torch.nn.Module | None  # the frozen KL reference (`grpo.kl_coef` > 0)
    rollout: RolloutPhase
    scorer: Scorer
    update: PolicyUpdate
    peak_flops: float  # this rank's device's, for verl's MFU
    # Around the steps.
    validator: Validator | None  # every `eval.every` steps
    saver: CheckpointWriter
    deadline: Deadline | None  # the job's end (`end_by`), when one is known
    run_log: RunLog | None  # rank 0's
    start: RunStart
    history: Trace  # the length history: `start`'s, then every step's responses

    # ---- one step -------------------------------------------------------------------------------
    def step(self, step: int, phases: StepPhases) -> StepReport:
        """Step `step`, its phases passed in `phases` (started at "rollout"), which a fault names."""
        cfg, G = self.cfg, self.cfg.grpo.group_size
        torch.manual_seed(step_seed(cfg.seed, step))
        t_step = time.perf_counter()
        if self.partial is None:
            batch = self.iterator.next_batch()
            prompts = [self.data[i] for i in batch.indices]
            rollout = self.rollout.run(step, prompts, self.history)
            epoch, records, partial = batch.epoch, history_records(rollout, batch.epoch), {}
        else:
            prompts, rollout, records, partial = self.partial.step(step, self.rollout, self.history)
            epoch = self.iterator.epoch
        phases.start("reward")

        rewards, counts, extras = self.score(prompts, rollout.responses, rollout.scored)
        all_error = check_error_share(step, counts, cfg.reward.max_error_share, self.rank)  # before the update
        advantages = group_advantages(rewards, G, cfg.grpo.std_normalize)
        phases.start("logprob")

        recomputed = self.update.recompute_logprobs(self.update.minibatches(rollout.responses, advantages))
        phases.start("update")

        stats = self.update.update(recomputed)
        self.optimizer.zero_grad(set_to_none=True)  # the rollout's KV gets the gradients' memory
        phases.start("sync")

        if cfg.verify_replicas:
            check_replicas(self.model, self.world)
        self.history = Trace(self.history.records + records, "length history")
        phases.end()

        times = phases.seconds
        lengths = [len(r.tokens) for r in rollout.responses]
        step_s = time.perf_counter() - t_step
        prompt_lens = [len(self.tok.encode_prompt(prompts[i // G])) for i in range(len(lengths))]
        return StepReport({
            "epoch": epoch,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "reward_outcomes": counts,
            **all_error,
            **({"reward_extra": extras} if extras else {}),
            **verl_figures(step, advantages.cpu(), prompt_lens, lengths, times, step_s, self.world,
                           cfg.model, self.peak_flops),
            **length_stats(lengths, [r.truncated for r in rollout.responses]),
            **rollout.figures.ledger,
            "stages": rollout.figures.stages,
            "layout": rollout.figures.layout,
            "placement": rollout.figures.placement,
            "phase_s": times,
            "step_s": step_s,
            "lease": rollout.figures.lease,
            **({"partial": partial} if partial else {}),
            "tokens_per_s": sum(lengths) / max(times["rollout"], 1e-9),
            "lr": self.optimizer.param_groups[0]["lr"],
            **stats,
            **gpu_memory(),
        }, rollout.figures.timeline)

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

    # ---- the run --------------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        state = {"data": self.iterator.state_dict(), "seed": self.cfg.seed,
                 "model": self.cfg.model.to_dict(), "ranks": self.world, "provenance": provenance()}
        if self.partial is not None:  # the carried responses, so a resume continues them
            state["partial"] = self.partial.state_dict()
        return state

    def validate(self, step: int) -> Validation:
        """The held-out evaluation (figures on rank 0, none elsewhere): a collective."""
        return self.validator.run(self.model, self.tok, self.rank, self.world, step)

    def run(self) -> dict:
        """Steps `start.step + 1` to `steps`, each checked, validated every `eval.every`, reported and
        saved every `checkpoint.every` and at the end; a stop signal or the deadline saves and ends
        the run early. Returns the run's summary (rank 0's is the one `train` prints)."""
        cfg, t0 = self.cfg, time.perf_counter()
        if self.start.sft_stopped:  # the warm start was stopped and saved: the requeue continues it
            return self._sft_stopped_summary()
        curve, stopped = [], None
        val_curve = self._first_validation(t0) if self.validator is not None and self.start.step == 0 else []
        try:
            with StopOnSignal(next(self.model.parameters()).device) as stop:
                for step in range(self.start.step + 1, cfg.steps + 1):
                    t_step = time.perf_counter()
                    phases = StepPhases("rollout")
                    with step_faults(self.rank, step, cfg.timeout_s, phases):
                        report = self.step(step, phases)
                    metrics, tables = report.metrics, {}
                    check_finite(step, metrics, self.out_dir)
                    if self.validator is not None and step % cfg.eval.every == 0:
                        val = self.validate(step)
                        metrics.update(val.metrics)
                        tables = val.tables
                        if "val" in metrics:
                            val_curve.append((step, metrics["val"]["pass@1"]))
                    curve.append(metrics["reward_mean"])
                    if self.run_log is not None:
                        self.run_log.step(step, metrics, report.timeline, tables, t0)
                    stopped = self._stop_after(step, stop, t_step)
                    if step == cfg.steps or stopped or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                        self._save(step, last=step == cfg.steps or bool(stopped))
                    if stopped:
                        break
            if cfg.checkpoint.export_hf and not stopped:
                export_hf(self.model, cfg.model, self.out_dir / "hf", self.rank, self.world, self.tok)
        finally:
            self.saver.close()  # a failed step: the pending save still ends (it was a good step's)
            if self.run_log is not None:
                self.run_log.close()
        summary = {"start_step": self.start.step, "steps": cfg.steps, "reward_curve": curve,
                   "wall_s": time.perf_counter() - t0}
        if val_curve:
            summary["val_pass@1"] = val_curve
        if stopped:  # a requeue, pre-emption or the job's end: the next run with this --out resumes here
            summary["stopped"] = stopped_summary(stopped, stop, self.deadline, self.out_dir, self.rank)
        return summary

    def _sft_stopped_summary(self) -> dict:
        if self.run_log is not None:
            self.run_log.close()
        return {"start_step": 0, "steps": self.cfg.steps, "reward_curve": [], "wall_s": 0.0,
                "stopped": self.start.sft_stopped}

    def _first_validation(self, t0: float) -> list[tuple[int, float]]:
        """The warm start's figure, before any RL update (a collective); the curve's first point on rank 0."""
        val = self.validate(0)
        if self.run_log is None:
            return []
        self.run_log.validation(val.metrics, val.tables, t0)
        return [(0, val.metrics["val"]["pass@1"])]

    def _stop_after(self, step: int, stop: StopOnSignal, t_step: float) -> int | None:
        """`step` when a stop signal or the deadline ends the run after it, else None. The last step
        needs no early stop: it is saved and exported anyway."""
        with step_faults(self.rank, step, self.cfg.timeout_s, StepPhases("stop-check")):
            if self.deadline is not None:
                self.deadline.after_step(time.perf_counter() - t_step)
            late = self.deadline is not None and self.deadline.must_stop()
            return step if stop.requested(late) and step < self.cfg.steps else None

    def _save(self, step: int, last: bool) -> None:
        """`last`: the run's final save (the last step, a stop), waited for before returning."""
        with step_faults(self.rank, step, self.cfg.timeout_s, StepPhases("checkpoint")):
            self.saver.save(step, self.model, self.optimizer, self.ref_model, self.trainer_state(), self.history,
                            last=last)
