"""The Triton decode kernels (rollout/decode_attention.py) in bf16, the GPU's dtype, on bf16
tensors in the Triton interpreter with its bf16 made exact (tests/triton_interpreter.py: operands
widened to fp32 before `tl.dot`, results rounded to nearest even), slot and paged cache, against
float64 on the same bf16 numbers: within 2 bf16 ulp of each (row, head)'s largest output.

Shapes: batch 1/7/64, GQA 8/4 and 32/4 (query heads / KV groups), head dim 128 (Qwen3-30B-A3B's),
pages of 4 and 16 positions (GRID below); lengths odd, a page size +-1, 0 (zeros out), 1 and
the cache's whole length; 1, 4 and 8 chunks. Negative control: the interpreter as shipped (bf16 dot
on raw bit patterns) fails the same comparison by orders of magnitude.
"""
import math

import pytest
import torch

from megatron_rl.rollout.decode_attention import decode_attention
from tests.triton_interpreter import exact_bf16, interpreted
from tests.unit.megatron_rl.rollout.test_decode_attention import paged

C = 128
ULPS = 2.0
# About 30 s of CPU for batch 64; a loaded 2-core machine stretches that several times.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(autouse=True)
def interpreter():
    with interpreted():
        yield


def reference64(q_BHC, K, V, slot_B, len_B) -> torch.Tensor:
    """softmax(q k^T / sqrt(C)) v in float64 over each row's keys; zeros for a zero-length row."""
    B, H, _ = q_BHC.shape
    hpg = H // K.shape[1]
    out = torch.zeros(B, H, q_BHC.shape[2], dtype=torch.float64)
    for b in range(B):
        s, n = int(slot_B[b]), int(len_B[b])
        if n:
            k = K[s, :, :n].double().repeat_interleave(hpg, 0)
            v = V[s, :, :n].double().repeat_interleave(hpg, 0)
            scores = (k @ q_BHC[b].double()[:, :, None])[..., 0] / math.sqrt(q_BHC.shape[2])
            out[b] = (torch.softmax(scores, -1)[:, None] @ v)[:, 0]
    return out


def error_ulps(got_BHC: torch.Tensor, want_BHC: torch.Tensor) -> float:
    """The largest error in bf16 ulps of each (row, head)'s largest |output| (an ulp there is
    2^(exponent - 7)); a zero row must be exactly zero."""
    scale = want_BHC.abs().amax(-1, keepdim=True)
    ulp = torch.where(scale > 0, torch.exp2(torch.floor(torch.log2(scale.clamp_min(1e-300))) - 7), 1e-300)
    return float(((got_BHC.double() - want_BHC).abs() / ulp).nan_to_num(float("inf")).max())


def case(B: int, H: int, G: int, P: int, seed: int):
    """q, K, V in bf16 (the slot cache: one slot per row, shuffled, one more unused), the slots and
    lengths: 0, 1, P - 1, P, P + 1, 2P +- 1 and odd lengths up to L (the whole cache, odd)."""
    g = torch.Generator().manual_seed(seed)
    L = 4 * P + 3
    K = torch.randn(B + 2, G, L, C, generator=g).bfloat16()
    V = torch.randn(B + 2, G, L, C, generator=g).bfloat16()
    q = torch.randn(B, H, C, generator=g).bfloat16()
    slot_B = torch.randperm(B + 1, generator=g)[:B]
    fixed = [L, 0, 1, P - 1, P, P + 1, 2 * P - 1, 2 * P + 1]
    odd = (2 * torch.randint(0, L // 2, (max(0, B - len(fixed)),), generator=g) + 1).tolist()
    return q, K, V, slot_B, torch.tensor((fixed + odd)[:B]), L


# Batches 1 and 7 with either GQA and either page size, batch 64 at 8/4 in pages of 16 (the
# default); chunks 8, 4 and 1. The interpreter runs one Python program per (row, group, chunk) and
# per (row, head), about 10 ms each: batch 64 costs 30 s of CPU per case here (CI's time), and
# adds no code path (the GQA widths share BLOCK_H 16; the page size only changes the addresses).
GRID = [(1, 8, 4, 4, 8), (1, 32, 4, 16, 8), (7, 8, 4, 16, 4), (7, 32, 4, 4, 4), (64, 8, 4, 16, 1)]


@pytest.mark.parametrize("B,H,G,P,splits", GRID)
def test_bf16_slot_and_paged_kernels_match_float64_within_two_ulps(B, H, G, P, splits):
    q, K, V, slot_B, len_B, L = case(B, H, G, P, seed=B + H + P)
    want = reference64(q, K, V, slot_B, len_B)
    K_pages, table_SJ = paged(K, P, seed=B)
    V_pages, _ = paged(V, P, seed=B)
    with exact_bf16():
        slot = decode_attention(q, K, V, slot_B, len_B, splits=splits, block_n=16)
        pages = decode_attention(q, K_pages, V_pages, slot_B, len_B, splits, 16, table_SJ=table_SJ, max_len=L)
    assert slot.dtype == pages.dtype == torch.bfloat16
    assert error_ulps(slot, want) <= ULPS, error_ulps(slot, want)
    assert torch.equal(pages, slot)  # the same chunks and sums, through the block table
    if B > 1:
        assert torch.equal(slot[(len_B == 0).nonzero()[0, 0]], torch.zeros(H, C, dtype=torch.bfloat16))


def test_the_shipped_interpreter_fails_the_bf16_comparison():
    """Negative control: without exact_bf16 the interpreter's bf16 dot multiplies bit patterns."""
    q, K, V, slot_B, len_B, _L = case(3, 8, 4, 4, seed=1)
    want = reference64(q, K, V, slot_B, len_B)
    assert error_ulps(decode_attention(q, K, V, slot_B, len_B, splits=2, block_n=16), want) > 1e3
    with exact_bf16():
        assert error_ulps(decode_attention(q, K, V, slot_B, len_B, splits=2, block_n=16), want) <= ULPS
