"""A stop signal during the SFT warm start saves a checkpoint (step 0, `sft_step` in its trainer
state), and a resume continues from it to the same weights as an uninterrupted warm start, on 2
gloo ranks with the sharded optimizer."""
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from megatron_rl.parallel.launch import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STEPS, STOP_AT = 6, 3


class _StopAt:
    """A `StopOnSignal` whose signal arrives during warm-start step `at` (every rank sees it)."""

    def __init__(self, at: int):
        self.at, self.calls, self.signum = at, 0, None

    def requested(self) -> bool:
        self.calls += 1
        if self.calls == self.at:
            self.signum = 15
        return self.signum is not None


def _warmstart(ctx, cfg, out: str, stop_at: int | None, resume: str | None):
    from megatron_rl.backends import backend
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.data.tokenizer import build_tokenizer
    from megatron_rl.rl.sft import sft_warmstart

    model = backend(cfg.backend).training_model(cfg, ctx.rank, ctx.world)
    warm = sft_warmstart(cfg, model, build_tokenizer(cfg.tokenizer), load_prompts(cfg.data), ctx.rank,
                           ctx.world, _StopAt(stop_at) if stop_at else None, out,
                           resume=Path(resume) if resume else None)
    import torch.distributed as dist

    mine = {n: p.detach().clone().numpy() for n, p in model.named_parameters()}
    every = [None] * ctx.world
    dist.all_gather_object(every, mine)
    return {"losses": warm.losses, "stopped": warm.stopped_at,
            "weights": {n: t for part in every for n, t in part.items()}}


def test_a_stopped_warm_start_saves_and_resumes_to_the_same_weights(tmp_path):
    from megatron_rl.config import load_dataclass
    from megatron_rl.trainer_config import TrainerConfig
    from tests.tiny_train import tiny_train_config

    cfg = load_dataclass(TrainerConfig, tiny_train_config(tmp_path), {"dtype": "float64"})
    cfg = replace(cfg, warmstart=replace(cfg.warmstart, sft_steps=STEPS, prompts_per_step=8))
    straight = run_ranks(_warmstart, 2, cfg, str(tmp_path / "a"), None, None, timeout_s=180)
    stopped = run_ranks(_warmstart, 2, cfg, str(tmp_path / "b"), STOP_AT, None, timeout_s=180)
    assert stopped["stopped"] == STOP_AT and stopped["losses"] == straight["losses"][:STOP_AT]
    ckpt = tmp_path / "b" / "checkpoints" / "step_000000"
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text() == ckpt.name
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 0 and state["sft_step"] == STOP_AT
    resumed = run_ranks(_warmstart, 2, cfg, str(tmp_path / "b"), None, str(ckpt), timeout_s=180)
    assert resumed["stopped"] is None
    assert stopped["losses"] + resumed["losses"] == straight["losses"]
    for n, w in straight["weights"].items():
        assert np.array_equal(w, resumed["weights"][n]), n


def _trainer_requeue(ctx, cfg, tmp: str):
    """Through `build_trainer` as `flexfloor train` runs it: a straight run; a run whose rank 0 gets
    SIGTERM during warm-start step 2 (saved, stopped); its requeue (resumed from that checkpoint)."""
    import os
    import signal

    import torch.distributed as dist

    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.rl import sft
    from megatron_rl.rl.checkpoint.dcp import latest_checkpoint
    from megatron_rl.trainer import build_trainer

    data = load_prompts(cfg.data)

    def weights(trainer):
        mine = {n: p.detach().clone().numpy() for n, p in trainer.model.named_parameters()}
        every = [None] * ctx.world
        dist.all_gather_object(every, mine)
        return {n: t for part in every for n, t in part.items()}

    straight = build_trainer(cfg, data, ctx, f"{tmp}/a", None)
    out = {"straight": straight.run(), "straight_w": weights(straight)}
    real_step, calls = sft.optimizer_step, []

    def signalled_step(*args):  # the signal arrives while warm-start step 2 computes
        calls.append(1)
        if len(calls) == 2 and ctx.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args)

    sft.optimizer_step = signalled_step
    try:
        out["stopped"] = build_trainer(cfg, data, ctx, f"{tmp}/b", None).run()
    finally:
        sft.optimizer_step = real_step
    resumed = build_trainer(cfg, data, ctx, f"{tmp}/b", latest_checkpoint(f"{tmp}/b"))
    out["resumed"], out["resumed_w"] = resumed.run(), weights(resumed)
    return out


def test_a_signal_during_the_warm_start_saves_and_the_requeue_continues(tmp_path):
    from megatron_rl.config import load_dataclass
    from megatron_rl.trainer_config import TrainerConfig
    from tests.tiny_train import tiny_train_config

    cfg = load_dataclass(TrainerConfig, tiny_train_config(tmp_path), {
        "dtype": "float64", "steps": 1, "warmstart.sft_steps": 4, "warmstart.prompts_per_step": 8,
        "logging.wandb_mode": "disabled", "verify_replicas": False})
    out = run_ranks(_trainer_requeue, 2, cfg, str(tmp_path), timeout_s=400)
    assert out["stopped"]["stopped"] == {"step": 0, "sft_step": 2, "signal": "SIGTERM"}
    assert out["stopped"]["reward_curve"] == []
    assert out["resumed"]["reward_curve"] == out["straight"]["reward_curve"] and "stopped" not in out["resumed"]
    for n, w in out["straight_w"].items():
        assert np.array_equal(w, out["resumed_w"][n]), n
