"""The elastic runtime on 4 gloo ranks: identical responses, invariants, and faults that end cleanly."""
import json

import pytest
from conftest import check_timeline, write_tiny_sidecar

from elastic.planning.dims import block_owners
from elastic.planning.plan import Assignment, Plan, Stage
from megatron_rl.config import load_dataclass
from megatron_rl.errors import FlexFloorError
from megatron_rl.parallel.launch import run_ranks
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout_runner import RolloutJob, prepare, rank_jobs, run_rollout, run_rollouts

BASE = {"batch.prompts": 8, "batch.samples": 4, "batch.length_scale": 0.01, "ranks": 4,
        "sampling.temperature": 0.8, "sampling.top_p": 0.9, "timeout_s": 60.0}


def config(**o):
    return load_dataclass(RolloutConfig, None, {**BASE, **o})


@pytest.mark.timeout(600)
def test_elastic_policies_equal_vanilla_and_keep_invariants(tmp_path):
    model, queries = write_tiny_sidecar(tmp_path, queries=8)
    variants = [dict(policy="vanilla")] + [
        dict(policy=p, floor=f) for p in ("natural", "planned") for f in (1, 2)]
    cfgs, labels = [], []
    for greedy in (True, False):
        for v in variants:
            leases = ["rewards", "sidecar"] if v.get("floor") == 1 else []
            cfgs.append(config(**v, **{"sampling.greedy": greedy, "leases": leases,
                                       "sidecar.checkpoint": model, "sidecar.queries": queries}))
            labels.append((greedy, v["policy"], v.get("floor")))
    results = run_rollouts(cfgs, quiet=True)
    shas = {}
    for (greedy, policy, floor), run in zip(labels, results):
        report, responses = run.report, run.responses
        keys = [(r["prompt_id"], r["sample"]) for r in responses]
        assert len(keys) == len(set(keys)) == 32, "a response was dropped or duplicated"
        assert report["rank_steps"] and sum(report["rank_steps"].values()) == 4 * report["rollout_steps"]
        for pool in report["pool"].values():  # every lease ended before the rollout returned
            assert all(lease["ended"] in ("finished", "preempted", "deadline") for lease in pool["leases"])
        shas.setdefault(greedy, {})[(policy, floor)] = report["responses_sha256"]
        timeline = check_timeline(report)
        # Each shrink is marked on the ranks of the group it leaves, the restore on every rank.
        entered = sorted(map(int, report["shrink_latency_s"]))
        left = [0] + entered[:-1] if entered else []  # the stage each shrink left
        assert sum(m.kind == "stage" for m in timeline.marks) == \
            sum(len(report["stages"][s]) for s in left) + (4 if report["final_stage"] else 0)
        leases = sum(len(p["leases"]) for p in report["pool"].values())
        assert sum(m.kind == "lease-start" for m in timeline.marks) == leases
        if policy == "natural" and floor == 1:
            assert report["final_stage"] > 0 and report["rank_seconds"]["idle"] + report["rank_seconds"]["leased"] > 0
    for greedy, by_policy in shas.items():
        assert len(set(by_policy.values())) == 1, (greedy, by_policy)
    assert shas[True][("vanilla", None)] != shas[False][("vanilla", None)]


FAULTS = {
    "kill-leased-rank": r"rank \d died \(exit code -9\); rank \d reported: rank \d, stage \d, phase \w+",
    "fail-transfer": r"rank \d failed: rank \d, stage 0, phase shrink: injected fault: sending expert",
    "stuck-lease": r"rank \d failed: rank \d, stage \d, phase detached: lease 'fault-stuck' did not yield",
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_ends_run_with_clear_error_and_keeps_finished_work(fault, tmp_path):
    cfg = config(policy="natural", floor=1, fault=fault, timeout_s=15.0, lease_grace_s=1.0)
    with pytest.raises(FlexFloorError, match=FAULTS[fault]):
        run_rollout(cfg, str(tmp_path), quiet=True)
    streamed = [json.loads(line) for f in tmp_path.glob("responses.rank*.jsonl") for line in f.open()]
    assert streamed, "finished responses must be on disk"
    assert len({(r["prompt_id"], r["sample"]) for r in streamed}) == len(streamed)
    assert list(tmp_path.glob("ledger.rank*.json")), "the ledger so far must be on disk"


@pytest.mark.timeout(240)
def test_misprediction_delays_the_stage_and_never_cuts():
    """A leaving rank that holds the longest response keeps its stage waiting, busy, to the end."""
    cfg = config(policy="vanilla")
    vanilla = prepare(cfg)
    by_len = sorted(vanilla.requests, key=lambda r: r.fixed_len)
    longest = by_len[-1]
    late = [r for r in by_len if r.fixed_len < longest.fixed_len][-1]
    # The longest response on rank 0 (resident), the second longest on rank 3: a plan that predicted
    # ranks 2 and 3 would drain first and leave at stage 1 is wrong about rank 3.
    others = [r for r in vanilla.requests if r is not longest and r is not late]
    assign = [Assignment(r.prompt_id, r.sample, i % 3 if r.fixed_len < late.fixed_len else 0)
              for i, r in enumerate(others)]
    assign += [Assignment(longest.prompt_id, longest.sample, 0), Assignment(late.prompt_id, late.sample, 3)]
    stages = [Stage((0, 1, 2, 3), (), block_owners(8, range(4))),
              Stage((0, 1), (2, 3), block_owners(8, (0, 1)))]
    plan = Plan(4, 2, 8, "planned", False, assign, stages)
    job = RolloutJob(cfg, vanilla.mcfg, vanilla.dims, others + [longest, late], plan, None)
    elastic_run, vanilla_run = run_ranks(rank_jobs, 4, [job, vanilla], True, timeout_s=60.0)
    report, vreport = elastic_run.report, vanilla_run.report
    assert report["responses_sha256"] == vreport["responses_sha256"]
    assert report["final_stage"] == 1
    r2, r3 = report["per_rank"][2]["steps"], report["per_rank"][3]["steps"]
    assert r3["busy"] >= late.fixed_len  # never cut: it decoded its whole response, then left
    assert r2["dummy"] > 0  # rank 2 waited in the group for rank 3: the stage was delayed
    assert r3["idle"] > 0 and r2["idle"] > 0
