"""A request exported from one engine and imported into another continues bit for bit."""
import pytest
import torch

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rollout.elastic_engines.torch_engine import MigratingRolloutEngine
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams


def _engine(model, sampling):
    e = MigratingRolloutEngine(RolloutEngine(model, sampling, 4, 64), 1)
    e.use_group(None, {x: 0 for x in range(model.config.num_moe_experts)})
    return e


def _requests():
    return [Request("a", 0, [5, 6, 7, 8, 9], 40, fixed_len=24), Request("b", 1, [3, 4], 40, fixed_len=30)]


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("after", [0, 1, 7])
def test_migrated_request_continues_identically(greedy, after):
    cfg = MoEModelConfig()
    model = Qwen3MoeModel(cfg, list(range(cfg.num_moe_experts)), torch.float64)
    model.init_weights(0)
    model.eval()
    sampling = SamplingParams(greedy=greedy, temperature=0.8, top_p=0.9, seed=3)
    ref = _engine(model, sampling)
    ref.engine.add(_requests())
    while ref.engine.has_work():
        ref.step()
    want = {r.key: r.tokens for r in ref.engine.finished}

    src, dst = _engine(model, sampling), _engine(model, sampling)
    src.engine.add(_requests())
    dst.engine.add([Request("c", 2, [1, 2, 3], 40, fixed_len=10)])  # the receiver has its own batch
    for _ in range(after):
        src.step()
        dst.step()
    header, ids, kv = src.export_request(("a", 0))
    dst.import_request(("a", 0), header, ids.clone(), kv.clone())
    src.release_request(("a", 0))
    assert [k for k, _, done in src.progress() if not done] == [("b", 1)]
    for e in (src, dst):
        while e.engine.has_work():
            e.step()
    got = {r.key: r.tokens for e in (src, dst) for r in e.engine.finished}
    assert got[("a", 0)] == want[("a", 0)] and got[("b", 1)] == want[("b", 1)]
