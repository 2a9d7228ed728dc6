"""The Triton split-K decode attention (rollout/decode_attention.py) equals SDPA over each row's own
keys, in fp32 and fp16 in the Triton interpreter on CPU (tests/triton_interpreter.py: the interpreter
runs the kernel's own code with numpy), over the slot cache and over the paged cache's block table
(bit for bit the slot cache's result on the same keys); a zero-length row gives zeros, and the split
count never falls as the cache grows. triton is in the dev extras: these run on every clean clone
(bf16: test_decode_attention_bf16.py)."""
import pytest
import torch

from megatron_rl.rollout.decode_attention import available, decode_attention, splits_for
from tests.triton_interpreter import interpreted


@pytest.fixture(autouse=True)
def interpreter():
    with interpreted():
        yield


def reference(q_BHC, K, V, slot_B, len_B):
    out = []
    for b in range(q_BHC.shape[0]):
        s, n = int(slot_B[b]), int(len_B[b])
        o = torch.nn.functional.scaled_dot_product_attention(
            q_BHC[b, :, None], K[s, :, :n], V[s, :, :n], enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("H,G,C,splits", [(4, 2, 16, 1), (8, 2, 32, 4), (4, 4, 16, 8)])
def test_split_k_decode_attention_equals_sdpa(H, G, C, splits):
    g = torch.Generator().manual_seed(H * C + splits)
    slots, L = 6, 70
    K = torch.randn(slots + 1, G, L, C, generator=g)
    V = torch.randn(slots + 1, G, L, C, generator=g)
    # Rows of very different lengths, slots out of order, one row shorter than the split count.
    slot_B = torch.tensor([[4, 9], [0, 9], [6, 9], [2, 9]])[:, 0]  # strided, as the engine's input column
    len_B = torch.tensor([70, 1, 3, 37])
    q = torch.randn(4, H, C, generator=g)
    assert available(q.device, C, q.dtype)
    got = decode_attention(q, K, V, slot_B, len_B, splits=splits, block_n=16)
    torch.testing.assert_close(got, reference(q, K, V, slot_B, len_B), rtol=1e-5, atol=1e-5)
    # Keys past a row's length are never read: garbage there changes nothing.
    K2, V2 = K.clone(), V.clone()
    for s, n in zip(slot_B.tolist(), len_B.tolist()):
        K2[s, :, n:], V2[s, :, n:] = float("nan"), float("nan")
    assert torch.equal(decode_attention(q, K2, V2, slot_B, len_B, splits=splits, block_n=16), got)


def test_engine_with_the_kernel_gives_the_torch_path_tokens():
    """The kernel wired into the engine's decode (slots from the input buffer's column, lengths =
    positions + 1), padded buckets included, against the SDPA path: the same greedy tokens."""
    from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
    from megatron_rl.rollout.decode_step import DecodeOptions
    from megatron_rl.rollout.engine import Request, RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    m = Qwen3MoeModel(MoEModelConfig(num_layers=1), dtype=torch.float32)
    m.init_weights(0)
    out = {}
    for attention in ("torch", "triton"):
        eng = RolloutEngine(m.eval(), SamplingParams(), 4, 16, decode=DecodeOptions(pad=True, attention=attention))
        assert (eng.attention.kernel is not None) == (attention == "triton")
        eng.add([Request(f"p{i}", 0, [i + 1] * (2 + i), 4, fixed_len=2 + i) for i in range(3)])
        while eng.has_work():
            eng.step()
        out[attention] = {r.key: r.tokens for r in eng.finished}
    assert out["triton"] == out["torch"]


def test_split_k_decode_attention_in_fp16_equals_sdpa():
    """fp16, one of the two dtypes the engine runs the kernel in on CUDA: the interpreter's numpy
    runs the same loads, fp32 scores and the cast of the result."""
    g = torch.Generator().manual_seed(5)
    K = torch.randn(5, 2, 40, 32, generator=g).half()
    V = torch.randn(5, 2, 40, 32, generator=g).half()
    q = torch.randn(3, 8, 32, generator=g).half()
    slot_B, len_B = torch.tensor([3, 0, 1]), torch.tensor([40, 2, 17])
    got = decode_attention(q, K, V, slot_B, len_B, splits=4, block_n=16)
    assert got.dtype == torch.float16
    want = reference(q.float(), K.float(), V.float(), slot_B, len_B)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


def paged(K_SGLC: torch.Tensor, P: int, seed: int):
    """The slot cache's keys in pages of P positions, the pages shuffled over the pool (one more,
    the scratch page, full of NaN: never read) and named by each slot's block table."""
    S, G, L, C = K_SGLC.shape
    J = -(-L // P)
    order = torch.randperm(S * J, generator=torch.Generator().manual_seed(seed))
    pool = torch.full((S * J + 1, G, P, C), float("nan"), dtype=K_SGLC.dtype)
    padded = torch.nn.functional.pad(K_SGLC, (0, 0, 0, J * P - L), value=float("nan"))
    pool[order] = padded.view(S, G, J, P, C).permute(0, 2, 1, 3, 4).reshape(S * J, G, P, C)
    return pool, order.view(S, J)


@pytest.mark.parametrize("dtype,P,splits", [(torch.float32, 16, 1), (torch.float32, 8, 4), (torch.float16, 16, 8)])
def test_paged_decode_attention_reads_the_block_table_and_equals_the_slot_kernel(dtype, P, splits):
    """Pages shuffled over the pool, a length not a multiple of P, rows shorter than the split count
    or than a page: the slot kernel's result bit for bit (the same chunks and sums), so SDPA's."""
    g = torch.Generator().manual_seed(P + splits)
    slots, L, G, H, C = 5, 37, 2, 8, 32
    K = torch.randn(slots + 1, G, L, C, generator=g).to(dtype)
    V = torch.randn(slots + 1, G, L, C, generator=g).to(dtype)
    q = torch.randn(4, H, C, generator=g).to(dtype)
    slot_B, len_B = torch.tensor([3, 0, 5, 1]), torch.tensor([37, 2, 1, 20])
    K_pages, table_SJ = paged(K, P, seed=1)
    V_pages, _ = paged(V, P, seed=1)
    got = decode_attention(q, K_pages, V_pages, slot_B, len_B, splits, 16, table_SJ=table_SJ, max_len=L)
    assert got.dtype == dtype and not got.isnan().any()
    assert torch.equal(got, decode_attention(q, K, V, slot_B, len_B, splits, 16))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    want = reference(q.float(), K.float(), V.float(), slot_B, len_B)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_engine_on_the_paged_cache_with_the_kernel_gives_the_slot_cache_tokens():
    """The paged cache's decode through the kernel (block table, padded buckets, pages taken
    between steps, a GRPO group sharing its prompt's pages) against its torch path and the slot cache."""
    from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
    from megatron_rl.rollout.decode_step import DecodeOptions
    from megatron_rl.rollout.engine import Request, RolloutEngine
    from megatron_rl.rollout.kv.kind import kv_kind
    from megatron_rl.rollout.sampling import SamplingParams

    m = Qwen3MoeModel(MoEModelConfig(num_layers=1), dtype=torch.float32)
    m.init_weights(0)
    out = {}
    for kv, attention in (("slots", "torch"), ("paged", "torch"), ("paged", "triton")):
        eng = RolloutEngine(m.eval(), SamplingParams(), 4, 24, kv=kv_kind(kv, page_size=4),
                            decode=DecodeOptions(pad=True, attention=attention))
        assert (eng.attention.kernel is not None) == (attention == "triton")
        eng.add([Request("p0", i, [5, 6, 7, 8, 9, 3], 9 - i, fixed_len=9 - i) for i in range(2)]
                + [Request("p1", 0, [2] * 3, 12, fixed_len=12)])
        while eng.has_work():
            eng.step()
        out[kv, attention] = {r.key: r.tokens for r in eng.finished}
    assert out["paged", "triton"] == out["paged", "torch"] == out["slots", "torch"]


@pytest.mark.parametrize("splits", [1, 4])
def test_a_zero_length_row_gives_zeros_not_nan_and_leaves_the_others_alone(splits):
    """Every chunk of a zero-length row is empty (lse -inf); the merge once made it NaN."""
    g = torch.Generator().manual_seed(splits)
    K = torch.randn(4, 2, 20, 16, generator=g)
    V = torch.randn(4, 2, 20, 16, generator=g)
    q = torch.randn(3, 4, 16, generator=g)
    slot_B, len_B = torch.tensor([2, 0, 1]), torch.tensor([13, 0, 20])
    got = decode_attention(q, K, V, slot_B, len_B, splits=splits, block_n=16)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    keep = torch.tensor([0, 2])
    assert torch.equal(got[keep], decode_attention(q[keep], K, V, slot_B[keep], len_B[keep], splits=splits,
                                                   block_n=16))
    K_pages, table_SJ = paged(K, 4, seed=3)
    V_pages, _ = paged(V, 4, seed=3)
    assert torch.equal(decode_attention(q, K_pages, V_pages, slot_B, len_B, splits, 16, table_SJ=table_SJ,
                                        max_len=20), got)


def test_the_split_count_never_falls_as_the_cache_grows():
    """It gave 2 chunks below 256 positions and 1 for 256-511."""
    counts = [splits_for(n) for n in range(1, 20_000)]
    assert all(a <= b for a, b in zip(counts, counts[1:]))
    assert counts[0] == 1 and counts[-1] == 16 and set(counts) == {1, 2, 4, 8, 16}
