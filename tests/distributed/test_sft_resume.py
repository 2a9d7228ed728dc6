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
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.data.tokenizer import build_tokenizer
    from megatron_rl.rl.model_setup import build_model
    from megatron_rl.rl.sft import sft_stopped, sft_warmstart

    model = build_model(cfg, ctx.rank, ctx.world)
    losses = sft_warmstart(cfg, model, build_tokenizer(cfg.tokenizer), load_prompts(cfg.data), ctx.rank,
                           ctx.world, _StopAt(stop_at) if stop_at else None, out,
                           resume=Path(resume) if resume else None)
    import torch.distributed as dist

    mine = {n: p.detach().clone().numpy() for n, p in model.named_parameters()}
    every = [None] * ctx.world
    dist.all_gather_object(every, mine)
    return {"losses": list(losses), "stopped": sft_stopped(losses),
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
