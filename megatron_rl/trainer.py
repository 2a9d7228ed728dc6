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
canonical order, so the rollout policy (vanilla or planned) changes nothing training sees. What is
checked before any rank starts, and the launch, are the driver's (train_driver.py).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.trace import Trace
from megatron_rl.backends import backend
from megatron_rl.data.iterator import PromptIterator
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.data.tokenizer import build_tokenizer
from megatron_rl.metrics import gpu_memory, length_stats
from megatron_rl.parallel.signals import StopOnSignal
from megatron_rl.provenance import provenance
from megatron_rl.rewards import OUTCOMES, Scorer, Verdict, mean_extras
from megatron_rl.rl.async_save import CheckpointWriter
from megatron_rl.rl.checkpoint import load_checkpoint, read_trainer_state
from megatron_rl.rl.deadline import run_deadline, stopped_summary
from megatron_rl.rl.grpo import group_advantages
from megatron_rl.rl.leases import TrainingLeases
from megatron_rl.rl.mixed_precision import training_state_bytes
from megatron_rl.rl.model_setup import export_hf
from megatron_rl.rl.partial import PartialRollouts
from megatron_rl.rl.rollout_phase import RolloutPhase, history_records, step_seed
from megatron_rl.rl.run_log import RunLog
from megatron_rl.rl.sft import sft_pending, sft_stopped, sft_warmstart
from megatron_rl.rl.step_faults import check_finite, step_faults
from megatron_rl.rl.train_step import check_replicas, frozen_copy
from megatron_rl.rl.update import PolicyUpdate
from megatron_rl.rl.validation import Validator
from megatron_rl.trainer_config import TrainerConfig
from megatron_rl.verl_metrics import device_peak_flops, verl_figures


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
            self.iterator.load_state_dict(state["data"], source=str(resume / "trainer_state.json"))
            if self.partial is not None and "partial" in state:
                self.partial.load_state_dict(state["partial"], source=str(resume / "trainer_state.json"))
            self.start_step = state["step"]
        self.scorer = Scorer(cfg.reward)
        self.peak_flops = device_peak_flops(ctx.device)
        self.validator = Validator(cfg, self.out_dir) if cfg.eval.every else None
        self.rollout = RolloutPhase.build(cfg, self.backend, self.model, self.tok, ctx,
                                          resident_bytes=training_state_bytes(self.model, self.optimizer,
                                                                              self.ref_model, world),
                                          leases=TrainingLeases(cfg, self.tok, rank, world), out_dir=self.out_dir)
        self.update = PolicyUpdate(cfg, self.model, self.optimizer, self.ref_model, self.tok.pad_id,
                                   rank, world)
        self.deadline = run_deadline(cfg.end_by, rank)  # the job's end: stop and save before it
        self.saver = CheckpointWriter(cfg.checkpoint.async_save, self.deadline and self.deadline.after_save)
        self.run_log = None
        if rank == 0:
            self.run_log = RunLog(cfg, self.out_dir, self.start_step if resume is not None else None,
                                  self.backend.describe())

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
        self.timeline = rollout.figures.timeline
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

    def run(self) -> dict:
        """Steps `start_step + 1` to `steps`, each checked, validated every `eval.every`, reported and
        saved every `checkpoint.every` and at the end; a stop signal or the deadline saves and ends
        the run early. Returns the run's summary (rank 0's is the one `train` prints)."""
        cfg, t0 = self.cfg, time.perf_counter()
        if self.sft_stopped:  # the warm start was stopped and saved: the requeue continues it
            return self._sft_stopped_summary()
        curve, stopped = [], None
        val_curve = self._first_validation(t0) if self.validator is not None and self.start_step == 0 else []
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
                    if self.run_log is not None:
                        tables = self.validator.tables() if "val" in metrics else {}
                        self.run_log.step(step, metrics, self.timeline, tables, t0)
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
        summary = {"start_step": self.start_step, "steps": cfg.steps, "reward_curve": curve,
                   "wall_s": time.perf_counter() - t0}
        if val_curve:
            summary["val_pass@1"] = val_curve
        if stopped:  # a requeue, pre-emption or the job's end: the next run with this --out resumes here
            summary["stopped"] = stopped_summary(stopped, stop, self.deadline, self.out_dir, self.rank)
        return summary

    def _sft_stopped_summary(self) -> dict:
        if self.run_log is not None:
            self.run_log.close()
        step, signum = self.sft_stopped
        return {"start_step": 0, "steps": self.cfg.steps, "reward_curve": [], "wall_s": 0.0,
                "stopped": {"step": 0, "sft_step": step, "signal": signal.Signals(signum).name}}

    def _first_validation(self, t0: float) -> list[tuple[int, float]]:
        """The warm start's figure, before any RL update (a collective); the curve's first point on rank 0."""
        val = self.validate(0)
        if self.run_log is None:
            return []
        self.run_log.validation(val, self.validator.tables(), t0)
        return [(0, val["val"]["pass@1"])]

    def _stop_after(self, step: int, stop: StopOnSignal, t_step: float) -> int | None:
        """`step` when a stop signal or the deadline ends the run after it, else None. The last step
        needs no early stop: it is saved and exported anyway."""
        with step_faults(self, step, "stop-check"):
            if self.deadline is not None:
                self.deadline.after_step(time.perf_counter() - t_step)
            late = self.deadline is not None and self.deadline.must_stop()
            return step if stop.requested(late) and step < self.cfg.steps else None

    def _save(self, step: int, last: bool) -> None:
        """`last`: the run's final save (the last step, a stop), waited for before returning."""
        with step_faults(self, step, "checkpoint"):
            self.saver.save(self.out_dir, step, self.model, self.optimizer, self.ref_model,
                            self.trainer_state(), self.history, self.rank,
                            (self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every), last=last)


# The phase that follows each one (named in a fault's message, `rl/step_faults.py`).
_NEXT_PHASE = {"rollout": "reward", "reward": "logprob", "logprob": "update", "update": "sync"}
