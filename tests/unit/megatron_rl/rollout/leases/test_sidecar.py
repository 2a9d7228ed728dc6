"""The sidecar serves a real checkpoint from a held-out JSONL file; pre-emption never loses a query."""
import pytest
from conftest import write_tiny_sidecar

from megatron_rl.errors import FlexFloorError
from megatron_rl.rollout.leases.sidecar import SidecarConfig, SidecarJob


@pytest.fixture(scope="module")
def sidecar_cfg(tmp_path_factory):
    model, queries = write_tiny_sidecar(tmp_path_factory.mktemp("sidecar"), queries=24)
    return SidecarConfig(model, queries, max_new_tokens=6, batch=5)


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


def test_a_sidecar_lease_needs_its_files(sidecar_cfg, tmp_path):
    with pytest.raises(FlexFloorError, match="sidecar lease needs sidecar.checkpoint"):
        SidecarConfig().check("leases", grace_s=5.0)
    with pytest.raises(FlexFloorError, match="expected a HuggingFace checkpoint directory"):
        SidecarConfig(str(tmp_path / "none"), sidecar_cfg.queries).preflight()
    with pytest.raises(FlexFloorError, match="q.jsonl"):
        SidecarConfig(sidecar_cfg.checkpoint, str(tmp_path / "q.jsonl")).preflight()
    with pytest.raises(FlexFloorError, match="drain_s"):
        SidecarConfig("m", "q.jsonl").check("leases", grace_s=1.0)
