"""Straggler KV migration on gloo ranks: the moved responses continue bit-identically, and a
receiver lost mid-migration ends the run with a clear error while the sender keeps the response."""
import json
import os

import pytest
import torch
from conftest import check_timeline

from megatron_rl.config import load_dataclass
from megatron_rl.errors import FlexFloorError
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout_runner import run_rollouts

BASE = {"batch.prompts": 8, "batch.samples": 4, "batch.length_scale": 0.01, "ranks": 4,
        "sampling.greedy": False, "sampling.temperature": 0.8, "sampling.top_p": 0.9, "timeout_s": 60.0}


@pytest.mark.timeout(600)
def test_adaptive_migrates_and_equals_vanilla(tmp_path):
    cfgs = [load_dataclass(RolloutConfig, None, {**BASE, **o})
            for o in ({"policy": "vanilla"}, {"policy": "adaptive", "floor": 1})]
    van_run, ada_run = run_rollouts(cfgs, quiet=True)
    van, ada, responses = van_run.report, ada_run.report, ada_run.responses
    assert ada["migrated"] > 0, "no request moved: the test proves nothing"
    assert ada["final_stage"] > 0
    assert len({(r["prompt_id"], r["sample"]) for r in responses}) == len(responses) == 32
    assert ada["responses_sha256"] == van["responses_sha256"]
    assert sum(ada["rank_steps"].values()) == 4 * ada["rollout_steps"]
    check_timeline(van)
    timeline = check_timeline(ada)
    # A move is marked on its sender and its receiver.
    assert sum(int(m.label.split()[0]) for m in timeline.marks if m.kind == "migrate") == 2 * ada["migrated"]
    # The figures `rollout --plot` and `demo --plot` draw from these reports.
    pytest.importorskip("matplotlib")
    from megatron_rl.commands.demo import write_demo_timelines
    from megatron_rl.commands.rollout import rollout_title, write_timeline

    assert write_timeline(ada, tmp_path / "timeline.png", rollout_title(ada)).stat().st_size > 5000
    write_demo_timelines(van, ada, str(tmp_path))
    assert {p.name for p in tmp_path.glob("timeline-*.png")} == {"timeline-vanilla.png", "timeline-adaptive.png",
                                                                   "timeline-demo.png"}


def _migrate_then_lose_receiver(ctx, out_dir: str):
    from elastic.planning.online.place import Decision
    from elastic.runtime.online import OnlineDriver
    from megatron_rl.models.config import MoEModelConfig
    from megatron_rl.models.qwen3_moe import Qwen3MoeModel
    from megatron_rl.rollout.elastic_engines.torch_engine import MigratingRolloutEngine
    from megatron_rl.rollout.engine import Request, RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    cfg = MoEModelConfig()
    model = Qwen3MoeModel(cfg, list(range(cfg.num_moe_experts)), torch.float64)
    model.init_weights(0)
    engine = MigratingRolloutEngine(RolloutEngine(model, SamplingParams(), 4, 64), 1)
    engine.use_group(None, {e: 0 for e in range(cfg.num_moe_experts)})  # local: no all-to-all
    if ctx.rank == 0:
        engine.engine.add([Request("p", 0, [1, 2, 3], 32, fixed_len=32)])
        for _ in range(4):
            engine.step()

    class Receiver:  # the receiving rank dies once the header has arrived
        def __getattr__(self, name):
            return getattr(engine, name)

        def empty_kv(self, held):
            os._exit(3)

    driver = OnlineDriver(rule=None, keys=[("p", 0)], rank_of=[0], rank=ctx.rank)
    try:
        driver.migrate(engine if ctx.rank == 0 else Receiver(), Decision(0, ((0, 1),)).moves)
    finally:
        if ctx.rank == 0:
            held = [(r.key, len(r.tokens)) for r in engine.engine.live]
            with open(os.path.join(out_dir, "sender.json"), "w") as f:
                json.dump(held, f)


@pytest.mark.timeout(120)
def test_receiver_lost_mid_migration_keeps_the_response_on_its_sender(tmp_path):
    from megatron_rl.parallel.launch import run_ranks

    with pytest.raises(FlexFloorError, match=r"rank 1 died \(exit code 3\)"):
        run_ranks(_migrate_then_lose_receiver, 2, str(tmp_path), timeout_s=10.0)
    held = json.loads((tmp_path / "sender.json").read_text())
    assert held == [[["p", 0], 4]], "the sender must still hold the response, with its tokens"


def _agree(ctx, out_dir: str):
    from elastic.planning.online.place import Decision
    from elastic.runtime.online import OnlineDriver
    from elastic.runtime.transport import DirectTransport

    class Engine:
        transport, device = DirectTransport(), torch.device("cpu")

    driver = OnlineDriver(rule=None, keys=[("p", 0)], rank_of=[0], rank=ctx.rank)
    same = driver.agree(Engine(), None, Decision(2, ((0, 1),)))
    differs = driver.agree(Engine(), None, Decision(2, ((0, 1 + (ctx.rank == 2)),)))
    with open(os.path.join(out_dir, f"agree{ctx.rank}.json"), "w") as f:
        json.dump([same, differs], f)


@pytest.mark.timeout(120)
def test_members_check_they_reached_the_same_decision(tmp_path):
    # One rank of three computing another move must be seen by every rank, before any acts on it.
    from megatron_rl.parallel.launch import run_ranks

    run_ranks(_agree, 3, str(tmp_path), timeout_s=30.0)
    assert [json.loads((tmp_path / f"agree{r}.json").read_text()) for r in range(3)] == [[True, False]] * 3
