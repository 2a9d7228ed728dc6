"""No padding row reaches a real row (models/moe.py). On CUDA `torch._grouped_mm` leaves the rows
past `offs[-1]` (the null expert's: padding of a CUDA-graph bucket) uninitialised, and a graph's
memory pool hands out memory that held anything; on CPU both come back clean, so this test makes
them poison: every fresh allocation (`empty`, `empty_like`, `empty_strided`, `new_empty`) is filled
with NaN, and so are `_grouped_mm`'s rows past `offs[-1]`. Then a padded MoE layer and a padded
decode step must give their real rows exactly the numbers of the same run without poison, and the
layer's padding rows zeros (`MoELayer`'s `masked_fill`, the only thing keeping their NaN in their
own rows). Negative control: without that `masked_fill` the padding rows come out NaN.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.models.moe import MoELayer
from megatron_rl.rollout.decode_step import DecodeOptions
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.request import Request
from megatron_rl.rollout.sampling import SamplingParams

CFG = MoEModelConfig(num_layers=2, hidden_size=64, num_moe_experts=8, moe_router_topk=2, vocab_size=256)
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class NaNPool(TorchDispatchMode):
    """Every fresh floating-point allocation comes back full of NaN (a reused graph pool's garbage)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name.split("::")[-1] in _ALLOCATIONS and out.is_floating_point():
            out.fill_(float("nan"))
        return out


@pytest.fixture
def poison(monkeypatch):
    """NaN in `_grouped_mm`'s rows past the last group (CUDA leaves them uninitialised) and in
    every fresh allocation, while the test's `with poison():` block runs."""
    grouped_mm = torch._grouped_mm

    def leaves_garbage(x, w, offs=None, **kw):
        out = grouped_mm(x, w, offs=offs, **kw)
        out[int(offs[-1]):] = float("nan")  # a test-side host read: the product never reads offs
        return out

    monkeypatch.setattr(torch, "_grouped_mm", leaves_garbage)
    return NaNPool


def layer_run(layer, x_TD, valid_T):
    with torch.inference_mode():  # the rollout's grouped path
        return layer(x_TD, valid_T)


def padded_layer():
    layer = MoELayer(CFG, range(CFG.num_moe_experts), torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x_TD = torch.randn(13, CFG.hidden_size, generator=g)
    valid_T = torch.ones(13, dtype=torch.bool)
    valid_T[[2, 7, 8, 12]] = False  # padding rows between and after real ones
    return layer, x_TD, valid_T


def test_padding_rows_of_the_moe_layer_stay_in_their_rows(poison):
    layer, x_TD, valid_T = padded_layer()
    clean = layer_run(layer, x_TD, valid_T)
    with poison():
        dirty = layer_run(layer, x_TD, valid_T)
    assert torch.equal(dirty[valid_T], clean[valid_T])
    assert torch.equal(dirty[~valid_T], torch.zeros_like(dirty[~valid_T]))


def test_without_the_mask_the_padding_rows_carry_nan(poison, monkeypatch):
    """Negative control: the layer's last `masked_fill` removed, the poison shows in the padding rows."""
    layer, x_TD, valid_T = padded_layer()
    fill = torch.Tensor.masked_fill  # the routing's fill (of expert ids, to the null expert) stays
    monkeypatch.setattr(torch.Tensor, "masked_fill",
                        lambda self, mask, value: self if self.is_floating_point() else fill(self, mask, value))
    with poison():
        dirty = layer_run(layer, x_TD, valid_T)
    assert dirty[~valid_T].isnan().all()


def test_a_padded_decode_step_in_a_poisoned_pool_gives_the_clean_tokens(poison):
    """5 requests in the 8-row bucket: three padding rows through every layer, as a graph replays them."""
    model = Qwen3MoeModel(CFG, dtype=torch.float32)
    model.init_weights(0)

    def run(mode) -> dict:
        eng = RolloutEngine(model.eval(), SamplingParams(greedy=True), 8, 24,
                            decode=DecodeOptions(pad=True, attention="torch"))
        eng.add([Request(f"p{i}", 0, [i + 3] * (2 + i), 6, fixed_len=6) for i in range(5)])
        with mode:
            while eng.has_work():
                eng.step()
        return {r.key: r.tokens for r in eng.finished}

    clean = run(torch.inference_mode())
    with torch.inference_mode():
        dirty = run(poison())
    assert dirty == clean and len(clean) == 5
