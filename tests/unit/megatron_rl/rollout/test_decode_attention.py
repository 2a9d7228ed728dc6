"""The Triton split-K decode attention (rollout/decode_attention.py) equals SDPA over each row's own
keys, in fp32 under TRITON_INTERPRET=1 on CPU (the interpreter runs the kernel's own code with numpy).
Skipped where triton is not installed: the CPU wheel of torch does not bring it, and the dev extras
do not add it (about 640 MB installed); `pip install triton==3.6.0` runs these here."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (not in the dev extras); the torch path runs instead")

from megatron_rl.rollout.decode_attention import available, decode_attention  # noqa: E402


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
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs under TRITON_INTERPRET=1 on CPU")
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
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs under TRITON_INTERPRET=1 on CPU")
    from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
    from megatron_rl.rollout.engine import Request, RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    m = Qwen3MoeModel(MoEModelConfig(num_layers=1), dtype=torch.float32)
    m.init_weights(0)
    out = {}
    for attention in ("torch", "triton"):
        eng = RolloutEngine(m.eval(), SamplingParams(), 4, 16, attention=attention, pad_to_buckets=True)
        assert (eng.cache.kernel is not None) == (attention == "triton")
        eng.add([Request(f"p{i}", 0, [i + 1] * (2 + i), 4, fixed_len=2 + i) for i in range(3)])
        while eng.has_work():
            eng.step()
        out[attention] = {r.key: r.tokens for r in eng.finished}
    assert out["triton"] == out["torch"]


def test_split_k_decode_attention_in_fp16_equals_sdpa():
    """fp16, one of the two dtypes the engine runs the kernel in on CUDA: the interpreter's numpy
    runs the same loads, fp32 scores and the cast of the result."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs under TRITON_INTERPRET=1 on CPU")
    g = torch.Generator().manual_seed(5)
    K = torch.randn(5, 2, 40, 32, generator=g).half()
    V = torch.randn(5, 2, 40, 32, generator=g).half()
    q = torch.randn(3, 8, 32, generator=g).half()
    slot_B, len_B = torch.tensor([3, 0, 1]), torch.tensor([40, 2, 17])
    got = decode_attention(q, K, V, slot_B, len_B, splits=4, block_n=16)
    assert got.dtype == torch.float16
    want = reference(q.float(), K.float(), V.float(), slot_B, len_B)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
