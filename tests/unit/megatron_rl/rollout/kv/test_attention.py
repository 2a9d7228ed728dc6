"""The torch path's decode attention (kv/attention.py `attend_keys`): each row's query heads over its
own keys up to its position, as SDPA computes it over that row's keys alone (no mask, no other
row). The paged cache runs the same function on its gathered pages (test_paged.py: its tokens
are the slot cache's bit for bit)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_rl.rollout.kv.attention import Attention, KVForward
from megatron_rl.rollout.kv.cache import KVLayout
from megatron_rl.rollout.kv.slots import SlotKVCache

LAYERS, SLOTS, G, L_MAX, C, H = 1, 6, 2, 40, 16, 4


def reference(q_BHC, K_SGLC, V_SGLC, slots, positions):
    out = []
    for b, (s, p) in enumerate(zip(slots, positions)):
        k, v = K_SGLC[s, :, : p + 1], V_SGLC[s, :, : p + 1]
        out.append(F.scaled_dot_product_attention(q_BHC[b, :, None], k, v, enable_gqa=True)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_each_row_attends_to_its_own_keys_up_to_its_position(dtype):
    cache = SlotKVCache(KVLayout(LAYERS, G, C, dtype), SLOTS, L_MAX)
    for _ in range(SLOTS):
        cache.alloc()
    g = torch.Generator().manual_seed(0)
    K = torch.randn(cache.shape, generator=g, dtype=torch.float64).to(dtype)
    V = torch.randn(cache.shape, generator=g, dtype=torch.float64).to(dtype)
    cache.k[0].copy_(K)
    cache.v[0].copy_(V)
    slots, positions = [4, 0, 5, 2], [30, 3, 0, 17]  # not a run: the gathered path
    B = len(slots)
    q_BHC = torch.randn(B, H, C, generator=g, dtype=torch.float64).to(dtype)
    k_new = torch.randn(B, G, 1, C, generator=g, dtype=torch.float64).to(dtype)
    v_new = torch.randn(B, G, 1, C, generator=g, dtype=torch.float64).to(dtype)
    slot_B, pos_B = torch.tensor(slots), torch.tensor(positions)
    batch = cache.decode_batch(slot_B, pos_B, max(positions) + 1, None)
    got = KVForward(Attention(cache), batch).attend(0, q_BHC[:, :, None], k_new, v_new)[:, :, 0]
    # The new key and value are in place before the row attends to them.
    for b, (s, p) in enumerate(zip(slots, positions)):
        K[s, :, p], V[s, :, p] = k_new[b, :, 0], v_new[b, :, 0]
    want = reference(q_BHC, K, V, slots, positions)
    if dtype == torch.bfloat16:  # half types keep SDPA over the masked range
        assert torch.allclose(got.float(), want.float(), atol=2e-2)
    else:
        assert torch.allclose(got, want, rtol=0, atol=1e-12 if dtype == torch.float64 else 2e-6)
