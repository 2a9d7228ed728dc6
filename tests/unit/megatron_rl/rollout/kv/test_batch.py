"""A forward's batch is explicit (rollout/kv/batch.py): the cache makes it and keeps nothing of it,
so the attention reads what that batch says, whatever the cache made since."""
import pytest
import torch

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.kv.attention import Attention, KVForward
from megatron_rl.rollout.kv.cache import KVLayout
from megatron_rl.rollout.kv.kind import PagedKV, SlotsKV
from megatron_rl.rollout.sampling import SamplingParams

G, C, H = 2, 8, 4
LAYOUT = KVLayout(2, G, C, torch.float64)


@pytest.mark.parametrize("kind", [SlotsKV(), PagedKV(page_size=4)], ids=["slots", "paged"])
def test_a_batch_carries_its_forward_whatever_the_cache_made_since(kind):
    cache = kind.cache(LAYOUT, 4, 16)
    a, b = cache.alloc(), cache.alloc()
    first = cache.prefill_batch([a], [5])
    cache.prefill_batch([b], [3])  # made, not run: it changes nothing the first one reads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 5, C, generator=g, dtype=torch.float64) for n in (H, G, G))
    KVForward(Attention(cache), first).attend(0, q, k, v)
    cache.commit(first)
    layer0 = torch.cat([k.reshape(-1), v.reshape(-1)])
    assert torch.equal(cache.export_kv(a, 5), torch.cat([layer0, torch.zeros_like(layer0)]))
    assert not cache.export_kv(b, 3).any()


@pytest.mark.parametrize("kind", [SlotsKV(), PagedKV(page_size=4)], ids=["slots", "paged"])
def test_nothing_of_a_forward_stays_in_the_cache_or_the_attention(kind):
    m = Qwen3MoeModel(MoEModelConfig(num_layers=1), dtype=torch.float64)
    m.init_weights(0)
    eng = RolloutEngine(m.eval(), SamplingParams(), 4, 32, kv=kind)
    before = set(vars(eng.cache)), dict(vars(eng.attention))
    eng.add([Request("p", i, [3, 1, 4, 1, 5], 6, fixed_len=6) for i in range(3)])
    for _ in range(3):  # a prefill, then decode steps
        eng.step()
    assert set(vars(eng.cache)) == before[0]
    assert vars(eng.attention) == before[1]
