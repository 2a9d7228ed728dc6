"""Training builds its rollout engine once per run (rl/rollout_phase/phase.py): the second step reuses the
engine, its KV cache and its graphs (the weights update in place), and every step's rollout report
says how often the engine was built and its graphs captured. When every step built a new
RecordingEngine, this test failed."""

from tests.gpu.checks import gpu_checks

TINY = gpu_checks.TINY_QWEN3_MOE


def _two_steps(ctx, cfg, out_dir):
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.trainer import build_trainer

    trainer = build_trainer(cfg, load_prompts(cfg.data), ctx, out_dir, None)
    reports, engines = [], []
    for step in (1, 2):
        batch = trainer.iterator.next_batch()
        result = trainer.rollout.run(step, [trainer.data[i] for i in batch.indices], trainer.history)
        reports.append(result.figures.ledger["engine"])
        engines.append(id(trainer.rollout.engine))
        assert len(result.responses) == cfg.prompts_per_step * cfg.grpo.group_size
    return {"reports": reports, "same_engine": engines[0] == engines[1], "builds": trainer.rollout.builds}


def test_the_second_step_builds_no_engine(tmp_path):
    from megatron_rl.parallel.launch import run_ranks

    cfg = gpu_checks.grpo_config(TINY, device="cpu", dtype="float32", prompts_per_step=2, group_size=2,
                                 max_response_len=4)
    out = run_ranks(_two_steps, 1, cfg, str(tmp_path), timeout_s=300, device="cpu")
    assert out["same_engine"] and out["builds"] == 1, out
    assert out["reports"] == [{"builds": 1, "graph_captures": 0}] * 2
