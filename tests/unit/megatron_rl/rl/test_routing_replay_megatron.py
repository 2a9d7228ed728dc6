"""Routing replay through megatron-core 0.16.1's TopKRouter (its `router_replay` hook, set to our
`RouteTap`), on one CPU rank under the test harness (tests/megatron_harness.py): the engine records
the same routes as the torch backend's, and replaying given routes gives the torch backend's
logits and router gradients."""
import torch

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.models.routes import RouteReplay, replaying

CFG = MoEModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                     num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, vocab_size=20)


def _pair():
    from megatron_rl.models.megatron_backend import install_megatron_moe
    from megatron_rl.rl.optim.megatron_train import training_groups

    models = []
    for _ in range(2):
        m = Qwen3MoeModel(CFG, None, torch.float32)
        m.init_weights(4)
        models.append(m)
    install_megatron_moe(models[1], training_groups(0, 1), dispatcher="alltoall", dtype=torch.float32,
                         expert_module="GroupedMM", device="cpu")
    return models


def test_megatron_router_records_and_replays_like_the_torch_router(megatron_harness, one_rank_group):
    from .test_routing_replay import _generate

    torch_model, mcore_model = _pair()
    _, want = _generate(torch_model)
    _, got = _generate(mcore_model)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k

    # Replay of routes the routers would not choose: both backends use them, with the gates of
    # their own router's scores, and the router gets the same gradient.
    ids = torch.tensor([[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]])
    mask = ids != 0
    mask[1, 4:] = False
    gen = torch.Generator().manual_seed(0)
    routes = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(12 * 2)]).view(12, 2, 2)
    out = {}
    for name, model in (("torch", torch_model), ("megatron", mcore_model)):
        for replay in (False, True):
            model.zero_grad()
            rep = RouteReplay(routes, mask.reshape(-1), mask.reshape(-1), replay, observe=False)
            with replaying(model, rep):
                logits = model(ids, token_mask_BS=mask)
                logits[mask].square().sum().backward()
            w = model.decoder.layers[0].mlp
            grad = (w.router.weight if name == "torch" else w.layer.router.weight).grad.clone()
            out[name, replay] = (logits.detach()[mask], grad)
    for i in (0, 1):
        torch.testing.assert_close(out["megatron", True][i], out["torch", True][i], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out["torch", True][0], out["torch", False][0])
    assert out["torch", True][1].abs().sum() > 0
