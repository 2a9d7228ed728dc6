"""The rollout fast paths compute the same numbers as the plain ones: the grouped expert GEMM over
stacked weights equals the per-expert matmuls, the stacked copy follows every weight write and
expert move, and the KV cache's view path (slots in a run) equals its gather path."""
import torch

from megatron_rl.models import MoEModelConfig
from megatron_rl.models.moe import ExpertBank
from megatron_rl.rollout.kv.attention import Attention, KVForward
from megatron_rl.rollout.kv.cache import KVLayout
from megatron_rl.rollout.kv.slots import SlotKVCache

CFG = MoEModelConfig()


def bank(experts, dtype=torch.float32, seed=0):
    b = ExpertBank(CFG, experts, dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in b.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    return b


def routed(experts, n=37, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, CFG.hidden_size, generator=g, dtype=dtype)
    pick = torch.tensor(experts)[torch.randint(0, len(experts), (n,), generator=g)]
    return x, pick


def test_grouped_gemm_equals_per_expert_matmuls():
    held = [1, 2, 5, 6]  # a subset with gaps, as a rank holds after a shrink
    b = bank(held)
    x, e = routed([2, 5, 6])  # expert 1 receives nothing: an empty group
    with torch.inference_mode():
        grouped = b.compute(x, e)
    loop = b.compute(x, e)  # autograd on: the per-expert path training uses
    assert loop.requires_grad
    assert torch.equal(grouped, loop.detach())


def test_the_local_dispatcher_takes_an_empty_batch():
    """A rank with no token this step (a dummy step) gets an empty [0, K, D] back (it raised on
    `.view(0, K, -1)`, whose -1 a zero-size tensor cannot infer)."""
    from megatron_rl.models.moe import LocalDispatcher

    x = torch.empty(0, CFG.hidden_size)
    out = LocalDispatcher()(x, torch.empty(0, 2, dtype=torch.long), bank([0, 1]))
    assert out.shape == (0, 2, CFG.hidden_size)


def test_float64_uses_per_expert_path_and_agrees():
    b = bank([0, 3], dtype=torch.float64)
    x, e = routed([0, 3], dtype=torch.float64)
    with torch.inference_mode():
        out = b.compute(x, e)
    ref = torch.empty_like(out)
    for ex in (0, 3):
        w1, w2 = b.get(ex).linear_fc1.weight, b.get(ex).linear_fc2.weight
        gate, up = (x[e == ex] @ w1.T).detach().chunk(2, dim=-1)
        ref[e == ex] = (torch.nn.functional.silu(gate) * up) @ w2.T.detach()
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_stacked_copy_follows_weight_writes_and_moves():
    b = bank([0, 1, 2])
    x, e = routed([0, 2])
    with torch.inference_mode():
        before = b.compute(x, e)
    with torch.no_grad():
        b.get(2).linear_fc2.weight.mul_(2.0)  # an optimizer step or weight sync writes in place
    with torch.inference_mode():
        after = b.compute(x, e)
    changed = e == 2
    assert torch.equal(after[~changed], before[~changed])
    assert not torch.equal(after[changed], before[changed])

    other = bank([4], seed=5)
    b.drop(1)
    b.add(4, other.get(4).linear_fc1.weight.detach(), other.get(4).linear_fc2.weight.detach())
    x4, e4 = routed([0, 4])
    with torch.inference_mode():
        moved = b.compute(x4, e4)
        alone = other.compute(x4[e4 == 4], e4[e4 == 4])
    assert b.held() == [0, 2, 4]
    assert torch.equal(moved[e4 == 4], alone)


def test_kv_cache_view_path_equals_gather_path():
    """Decode attention through a view of consecutive slots equals the gather path (slots out of
    order) row for row, bit for bit; the CUDA graphs' torch path (key length L_max, the keys past a
    row masked) agrees to rounding (CPU SDPA blocks the longer key axis differently)."""
    G, C, H, layers = 2, 4, 4, 1
    g = torch.Generator().manual_seed(0)
    caches = {name: SlotKVCache(KVLayout(layers, G, C, torch.float64), 4, 16) for name in ("run", "gather", "graph")}
    order = {"run": [1, 2, 3], "gather": [3, 1, 2], "graph": [2, 3, 1]}
    lens = {1: 3, 2: 5, 3: 2}
    for name, cache in caches.items():
        for _ in range(4):
            cache.alloc()
        for s in order[name]:  # prefill each slot alone, with the same keys everywhere
            gs = torch.Generator().manual_seed(s)
            k = torch.randn(1, G, lens[s], C, generator=gs, dtype=torch.float64)
            batch = cache.prefill_batch([s], [lens[s]])
            q = torch.randn(1, H, lens[s], C, dtype=torch.float64)
            KVForward(Attention(cache), batch).attend(0, q, k, k.clone())
            cache.commit(batch)
    for _ in range(3):
        q = torch.randn(3, H, 1, C, generator=g, dtype=torch.float64)
        k = torch.randn(3, G, 1, C, generator=g, dtype=torch.float64)
        v = torch.randn(3, G, 1, C, generator=g, dtype=torch.float64)
        out = {}
        for name, cache in caches.items():
            perm = [order["run"].index(s) for s in order[name]]
            pos = torch.tensor([cache.lengths[s] for s in order[name]])
            L = {"run": int(pos.max()) + 1, "gather": int(pos.max()) + 1, "graph": 16}[name]
            batch = cache.decode_batch(torch.tensor(order[name]), pos, L, slice(1, 4) if name == "run" else None)
            o = KVForward(Attention(cache), batch).attend(0, q[perm], k[perm], v[perm])
            out[name] = {s: o[i] for i, s in enumerate(order[name])}
            for s in order[name]:
                cache.lengths[s] += 1
        for s in order["run"]:
            assert torch.equal(out["gather"][s], out["run"][s])
            torch.testing.assert_close(out["graph"][s], out["run"][s], rtol=1e-13, atol=1e-13)
