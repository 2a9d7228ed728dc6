"""Partial rollouts on 2 gloo ranks, through the trainer: a response left unfinished at step 1 is
resumed at step 2, after the weight update, by re-prefilling its prompt and tokens so far under the
new weights; its tokens and behaviour log-probs so far are kept, the new ones are the new policy's,
and each token carries the version that sampled it."""
import json
import os

import pytest

from megatron_rl.parallel.launch import run_ranks
from tests.helpers.train import trainer_step

CONFIG = {
    "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
              "kv_channels": 8, "num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
              "vocab_size": 20},
    "grpo": {"group_size": 4, "micro_batch": 8, "tis_cap": 2.0},
    "optim": {"lr": 0.01},
    "generation": {"max_response_len": 8},
    "warmstart": {"sft_steps": 30, "prompts_per_step": 16},
    "logging": {"wandb_mode": "disabled"},
    "partial": {"enabled": True, "over_sample": 1.0},
    "steps": 2, "prompts_per_step": 4, "seed": 5, "dtype": "float64", "ranks": 2,
}


def _resume_across_update(ctx, data_path: str, out_dir: str):
    import torch

    from megatron_rl.config import load_dataclass
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.rl.update.train_step import pack, sequence_logprobs
    from megatron_rl.trainer import build_trainer
    from megatron_rl.trainer_config import TrainerConfig

    cfg = load_dataclass(TrainerConfig, None, {**CONFIG, "data": {"path": data_path}})
    trainer = build_trainer(cfg, load_prompts(cfg.data), ctx, out_dir, None)
    trainer_step(trainer, 1)  # rollout of policy 1, then the weight update
    carried = {s.rid: (list(s.tokens), list(s.logprobs)) for g in trainer.partial.pool.pending
               for s in g.samples if not s.done and s.n}
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer_step(trainer, 2)  # resumed under policy 2
    assert any((a != p).any() for a, p in zip(before, trainer.model.parameters())), "no weight update"
    # Step 2 trained the oldest complete groups and kept the others: find every carried response.
    where = {s.rid: (g, s) for g in [*trainer.partial.pool.pending, *trainer.partial.last_trained]
             for s in g.samples}
    rows = []
    for rid, (tokens, logprobs) in carried.items():
        g, s = where[rid]
        assert s.tokens[:len(tokens)] == tokens and s.logprobs[:len(logprobs)] == logprobs
        versions = s.versions()
        assert versions[:len(tokens)] == [1] * len(tokens) and set(versions[len(tokens):]) <= {2}
        if s.n > len(tokens):
            rows.append((trainer.partial.ids(g.payload["index"]), s, len(tokens)))
    # The new tokens' behaviour log-probs are the new weights' on prompt + all tokens before them
    # (the re-prefill conditioned on the carried tokens); the carried ones' are not (older weights).
    new_close, old_differ = [], []
    if rows:
        packed = pack([(ids, s.tokens) for ids, s, _ in rows], trainer.tok.pad_id)
        with torch.no_grad():
            for p, w in zip(trainer.model.parameters(), before):  # policy 2: the rollout's weights
                p.copy_(w)
            logp = sequence_logprobs(trainer.model, packed, cfg.generation.temperature)
        for b, (_, s, n_old) in enumerate(rows):
            got = logp[b][packed.loss_mask[b].bool()].tolist()
            new_close.append(max(abs(x - y) for x, y in zip(got[n_old:], s.logprobs[n_old:])))
            old_differ.append(max(abs(x - y) for x, y in zip(got[:n_old], s.logprobs[:n_old])))
    report = {"carried": len(carried), "checked": len(rows)}
    report.update(checked=len(rows), new_close=new_close, old_differ=old_differ)
    with open(os.path.join(out_dir, f"report{ctx.rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_carried_responses_resume_across_a_weight_update(tmp_path):
    from megatron_rl.data.arith import make_problems, write_jsonl

    data = tmp_path / "arith.jsonl"
    write_jsonl(make_problems(40, seed=0, max_operand=9, ops="+"), data)
    run_ranks(_resume_across_update, 2, str(data), str(tmp_path), timeout_s=120.0)
    reports = [json.loads((tmp_path / f"report{r}.json").read_text()) for r in range(2)]
    assert reports[0] == reports[1], "the ranks' pools differ"
    rep = reports[0]
    assert rep["carried"] > 0 and rep["checked"] > 0, f"no response was resumed: the test proves nothing ({rep})"
    # The update computes log-probs through one float32 log-softmax: agreement to float32 rounding.
    assert max(rep["new_close"]) < 1e-5, rep
    assert min(rep["old_differ"]) > 1e-2, rep


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_partial_rollout_shrinks_leases_and_restores_as_before():
    """`flexfloor rollout` with partial on a planned floor-1 plan: ranks drain and leave, the end
    rule stops the members with requests live, the world is restored and checked, the ledger sums,
    and every response is either finished or reported as carried."""
    from megatron_rl.config import load_dataclass
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout_runner import run_rollouts

    cfg = load_dataclass(RolloutConfig, None, {
        "batch.prompts": 16, "batch.samples": 4, "ranks": 4, "policy": "planned", "floor": 1,
        "tailguard": True, "timeout_s": 120.0, "leases.jobs": ["rewards"],
        "partial.enabled": True, "partial.over_sample": 0.5})
    (run,) = run_rollouts([cfg], quiet=True)
    report, responses = run.report, run.responses
    p = report["partial"]
    assert report["final_stage"] > 0, "no shrink before the end rule: the test proves nothing"
    assert p["carried"] > 0 and p["groups_complete"] >= p["target_groups"] == 10
    assert len(responses) + p["carried"] == 64
    assert len({(r["prompt_id"], r["sample"]) for r in responses}) == len(responses)
    assert sum(report["rank_steps"].values()) == 4 * report["rollout_steps"]
