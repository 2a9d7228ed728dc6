"""Decode attention over each row's own length: a two-stage split-K Triton kernel, for the slot
and the paged KV cache.

One query token per row (decode), keys and values read straight from the cache at the row's
sequence, positions 0..len_B[b]-1 only: no gather of the prefix, no mask tensor, nothing read back
to the host, one launch shape per batch size (CUDA-graph safe). The slot cache ([slots + 1, G,
L_max, C]) holds a row's keys in its slot; the paged cache ([pages + 1, G, P, C]) in the pages its
block table names ([slots + 1, J], a static device tensor updated in place as pages are taken):
key n of row b is position n % P of page table[slot_B[b], n // P], looked up per key as SGLang and
lightllm look up their token tables. One kernel serves both: `PAGE` (a compile-time constant, 0 for
the slot cache) picks the addressing, so the slot cache's code is what it was.
The model is SGLang's triton decode attention (`triton_ops/decode_attention.py`, from lightllm):
stage 1 splits each row's keys into `SPLITS` chunks and runs an online softmax over
each, one program per (row, KV group, chunk) covering the group's H/G query heads (GQA) with one
`tl.dot`; stage 2 merges the chunks by their log-sum-exp. Scores and sums in fp32. The chunks and
blocks depend on the row's length and the cache's longest sequence only, so the slot and the paged
cache of one `max_len` add the same numbers in the same order: the same result, bit for bit.

Tested on CPU under `TRITON_INTERPRET=1` (triton is in the dev extras) in fp32 and fp16 against SDPA
and in bf16, with the interpreter's bf16 made exact (tests/triton_bf16.py), against float64
(tests/unit/megatron_rl/rollout/test_decode_attention.py, test_decode_attention_bf16.py), and
compiled for sm90 without a GPU for every constant set the GPU checks use
(tests/unit/megatron_rl/rollout/test_decode_attention_sm90.py); the rollout engine uses it on CUDA
(`available`), and the torch path (a masked key range, `attend_keys` in rollout/kv/attention.py) everywhere else.
"""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel of torch comes without triton: the torch path runs instead
    triton = None


def available(device: torch.device, head_dim: int, dtype: torch.dtype) -> bool:
    """The kernel runs here: triton importable, a head dim that `tl.arange` can span (a power of
    two, at least 16), and a CUDA device in bf16/fp16 (in fp32 `tl.dot` would round through TF32)
    or the interpreter (fp32 on CPU)."""
    if triton is None or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    if device.type == "cuda":
        return dtype in (torch.bfloat16, torch.float16)
    return _interpreting() and dtype == torch.float32


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _split_kernel(Q, K, V, Slot, Table, Len, MidO, MidL, scale,
                      s_qb, s_qh, s_tb, s_ks, s_kg, s_kn, s_vs, s_vg, s_vn, s_ob, s_oh, s_os, s_lb, s_lh,
                      HPG: tl.constexpr, BLOCK_H: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLITS: tl.constexpr, ITERS: tl.constexpr, PAGE: tl.constexpr):
        b, g, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(Slot + b).to(tl.int64)
        length = tl.load(Len + b)
        chunk = tl.cdiv(length, SPLITS)
        start = sp * chunk
        end = tl.minimum(start + chunk, length)
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < HPG
        heads = g * HPG + offs_h
        offs_c = tl.arange(0, C)
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_c[None, :], mask=mask_h[:, None], other=0.0)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, C], tl.float32)
        if PAGE == 0:  # the slot cache: the row's keys are its slot's
            k_base = K + slot * s_ks + g * s_kg
            v_base = V + slot * s_vs + g * s_vg
        else:  # the paged cache: pages anywhere in the pool, named by the row's block table
            k_base = K + g * s_kg
            v_base = V + g * s_vg
            table = Table + slot * s_tb
        # A fixed trip count (the longest chunk's blocks), the blocks past `end` masked off: the
        # same code under the interpreter, whose numpy 2 will not turn a loaded length into a range bound.
        for i in range(ITERS):
            offs_n = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            if PAGE == 0:
                k_rows = offs_n * s_kn
                v_rows = offs_n * s_vn
            else:
                page = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
                k_rows = page * s_ks + (offs_n % PAGE) * s_kn
                v_rows = page * s_vs + (offs_n % PAGE) * s_vn
            k = tl.load(k_base + k_rows[:, None] + offs_c[None, :], mask=mask_n[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * scale
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_base + v_rows[:, None] + offs_c[None, :], mask=mask_n[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
            den = den * alpha + tl.sum(p, 1)
            m = m_new
        # An empty chunk (a row shorter than SPLITS keys) says so with lse = -inf: weight 0 in the merge.
        nonempty = den > 0
        out = tl.where(nonempty[:, None], acc / tl.where(nonempty, den, 1.0)[:, None], 0.0)
        lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, den, 1.0)), float("-inf"))
        tl.store(MidO + b * s_ob + heads[:, None] * s_oh + sp * s_os + offs_c[None, :], out, mask=mask_h[:, None])
        tl.store(MidL + b * s_lb + heads * s_lh + sp, lse, mask=mask_h)

    @triton.jit
    def _merge_kernel(MidO, MidL, Out, s_ob, s_oh, s_os, s_lb, s_lh, s_xb, s_xh,
                      C: tl.constexpr, SPLITS: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        offs_s = tl.arange(0, SPLITS)
        offs_c = tl.arange(0, C)
        lse = tl.load(MidL + b * s_lb + h * s_lh + offs_s)
        # An empty chunk weighs 0. A zero-length row has only empty chunks (every lse -inf, where
        # exp(lse - max) would be exp(-inf + inf) = NaN): its output is zeros, not NaN. Other rows
        # get the weights and sum they always had, bit for bit.
        w = tl.where(lse > float("-inf"), tl.exp(lse - tl.max(lse, 0)), 0.0)
        den = tl.sum(w, 0)
        o = tl.load(MidO + b * s_ob + h * s_oh + offs_s[:, None] * s_os + offs_c[None, :])
        out = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
        tl.store(Out + b * s_xb + h * s_xh + offs_c, out.to(Out.dtype.element_ty))


def splits_for(max_len: int) -> int:
    """Chunks per row: the power of two at or above max_len // 256, at most 16 (the merge spans it
    with `tl.arange`): each chunk holds at least 128 positions (4 blocks of 32), a longer cache never
    gets fewer chunks, and more chunks fill the device at small batch. Below 512 positions: one."""
    return min(16, 1 << (max(1, max_len // 256) - 1).bit_length())


def constants(H: int, G: int, C: int, max_len: int, splits: int | None = None, block_n: int = 32,
              page: int = 0) -> dict:
    """The split kernel's compile-time constants for H query heads over G KV groups of head dim C
    and a KV cache of `max_len` positions per sequence, in slots (`page` 0) or in pages of `page`
    positions (the merge kernel's are its C and SPLITS); one set per model shape, cache length and
    page size (tests/unit/megatron_rl/rollout/test_decode_attention_sm90.py compiles each for sm90)."""
    hpg, splits = H // G, splits or splits_for(max_len)
    return {"HPG": hpg, "BLOCK_H": max(16, 1 << (hpg - 1).bit_length()), "C": C, "BLOCK_N": block_n,
            "SPLITS": splits, "ITERS": math.ceil(math.ceil(max_len / splits) / block_n), "PAGE": page}


def decode_attention(q_BHC: torch.Tensor, k_SGLC: torch.Tensor, v_SGLC: torch.Tensor, slot_B: torch.Tensor,
                     len_B: torch.Tensor, splits: int | None = None, block_n: int = 32,
                     table_SJ: torch.Tensor | None = None, max_len: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(C)) v for each row b over keys 0..len_B[b]-1 of sequence slot_B[b]; query
    head h reads KV group h // (H/G). Returns [B, H, C] in q's dtype. Without `table_SJ`, K and V
    are the slot cache's ([slots + 1, G, L_max, C]); with it, the paged cache's pages ([pages + 1,
    G, P, C]) and each sequence's block table, its sequences at most `max_len` positions long."""
    B, H, C = q_BHC.shape
    G, P = k_SGLC.shape[1], k_SGLC.shape[2]
    paged = table_SJ is not None
    const = constants(H, G, C, (max_len or table_SJ.shape[1] * P) if paged else P, splits, block_n, P if paged else 0)
    splits = const["SPLITS"]
    # The kernel indexes these by row: contiguous (the engine's slots are a column of its input buffer).
    q_BHC, slot_B, len_B = q_BHC.contiguous(), slot_B.contiguous(), len_B.contiguous()
    table_SJ = table_SJ.contiguous() if paged else slot_B  # the slot cache's kernel never reads it
    mid_o = torch.empty(B, H, splits, C, dtype=torch.float32, device=q_BHC.device)
    mid_l = torch.empty(B, H, splits, dtype=torch.float32, device=q_BHC.device)
    out = torch.empty_like(q_BHC)
    _split_kernel[(B, G, splits)](
        q_BHC, k_SGLC, v_SGLC, slot_B, table_SJ, len_B, mid_o, mid_l, 1.0 / math.sqrt(C),
        q_BHC.stride(0), q_BHC.stride(1), table_SJ.stride(0), k_SGLC.stride(0), k_SGLC.stride(1), k_SGLC.stride(2),
        v_SGLC.stride(0), v_SGLC.stride(1), v_SGLC.stride(2), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_l.stride(0), mid_l.stride(1), **const)
    _merge_kernel[(B, H)](mid_o, mid_l, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
                          mid_l.stride(0), mid_l.stride(1), out.stride(0), out.stride(1), C=C, SPLITS=splits)
    return out
