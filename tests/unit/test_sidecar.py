"""The sidecar serves a real checkpoint from a held-out JSONL file; pre-emption never loses a query."""
import pytest

from megatron_rl.data.arith import make_problems, write_jsonl
from megatron_rl.errors import FlexFloorError
from megatron_rl.rollout.sidecar import SidecarConfig, SidecarJob

SHAPE = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
             num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=16, vocab_size=20)


@pytest.fixture(scope="module")
def sidecar_cfg(tmp_path_factory):
    """A HuggingFace checkpoint on disk (random weights: this tests serving, not skill) and queries."""
    from megatron_rl.models import Qwen3MoeModel, save_hf_checkpoint
    from megatron_rl.models.config import MoEModelConfig

    tmp = tmp_path_factory.mktemp("sidecar")
    model = Qwen3MoeModel(MoEModelConfig(**SHAPE))
    model.init_weights(3)
    save_hf_checkpoint(model, tmp / "model")
    write_jsonl(make_problems(24, seed=1, max_operand=9), tmp / "q.jsonl")
    return SidecarConfig(str(tmp / "model"), str(tmp / "q.jsonl"), max_new_tokens=6, batch=5)


def preempt_after(calls):
    n = [0]

    def preempted():
        n[0] += 1
        return n[0] > calls
    return preempted


def test_preemption_restarts_queries_and_counts_each_once(sidecar_cfg):
    whole = SidecarJob(sidecar_cfg, repeat=False)
    whole.run(lambda: False)
    assert whole.done() and whole.report()["served"] == 24 and whole.report()["restarts"] == 0
    cut = SidecarJob(sidecar_cfg, repeat=False)
    leases = 0
    while not cut.done() and leases < 100:
        cut.run(preempt_after(8))  # every lease is pre-empted after eight engine steps
        leases += 1
    rep = cut.report()
    assert cut.done() and leases >= 2 and rep["restarts"] > 0
    assert rep["served"] == rep["distinct"] == 24
    assert cut.queue.answered == whole.queue.answered  # a restarted query answers as an uninterrupted one
    assert rep["accuracy"] == whole.report()["accuracy"]


def test_shares_split_the_file_and_passes_repeat(sidecar_cfg):
    shares = [SidecarJob(sidecar_cfg, rank, 3, repeat=False) for rank in range(3)]
    ids = [r.prompt_id for job in shares for r in job.queue.rows]
    assert len(ids) == len(set(ids)) == 24
    looping = SidecarJob(sidecar_cfg, 0, 3)
    looping.run(preempt_after(40))
    rep = looping.report()
    assert rep["passes"] >= 2 and rep["served"] > rep["distinct"] == 8 and not looping.done()


def test_a_sidecar_lease_needs_its_files():
    with pytest.raises(FlexFloorError, match="sidecar lease needs sidecar.checkpoint"):
        SidecarConfig().check("leases", grace_s=5.0)
    with pytest.raises(FlexFloorError, match="drain_s"):
        SidecarConfig("m", "q.jsonl").check("leases", grace_s=1.0)
