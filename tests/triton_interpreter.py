"""The Triton interpreter for the decode kernels' tests, and exact bf16 in it (tests only: the
product never imports this file).

`interpreted()`: while inside, rollout/decode_attention.py's kernels run in the interpreter on CPU
tensors (`TRITON_INTERPRET=1` for `decode_attention.available`, and the kernels rebuilt as
`InterpretedFunction`s of the same code), whatever the environment was when the module was
imported, and nothing outlives the block: setting `TRITON_INTERPRET=1` in a test module's import
instead would reach every test collected in the same process (and every rank it spawns), whose fp32
engines would then all pick the interpreted kernel.

`exact_bf16()`: the interpreter (triton 3.5 and 3.6 alike) holds a bf16 tensor as its raw uint16
bit patterns, so its `tl.dot` multiplies those bit patterns as integers (garbage), and its fp32 ->
bf16 cast truncates where a GPU rounds to nearest even (`cvt.rn.bf16.f32`). Inside, the interpreter
does what an sm90 GPU does with the decode kernels' bf16:
- `tl.dot` on a bf16 operand widens it to fp32 exactly (a bf16 is the top half of an fp32) and
  multiplies and accumulates in fp32, as the tensor cores do (the order of the sum may differ);
- an fp32 -> bf16 cast (`.to(tl.bfloat16)`, a store's conversion) rounds to nearest, ties to even;
  bf16 -> fp32 is exact.
Nothing else changes: loads and stores move the same bits. tests/unit/megatron_rl/rollout/
test_decode_attention_bf16.py runs the kernels under it against float64, and without it as the
negative control (the shipped interpreter fails those tests).
"""
from __future__ import annotations

import contextlib
import os
from unittest import mock

import numpy as np
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder, TensorHandle
from triton.runtime.jit import JITFunction

from megatron_rl.rollout import decode_attention

_DEVICE_FNS: dict = {}  # id(JITFunction) -> its InterpretedFunction, made once (they live as long as triton)


def _device_call(self, *args, **kwargs):
    """A @triton.jit function called from an interpreted kernel (tl.cdiv, tl.sum, tl.zeros...: the
    standard library's, made JITFunctions when triton was imported without TRITON_INTERPRET), run as
    the interpreter runs it when the variable was set at import."""
    if id(self) not in _DEVICE_FNS:  # by id: a JITFunction hashes by parsing its source
        _DEVICE_FNS[id(self)] = InterpretedFunction(self.fn)
    return _DEVICE_FNS[id(self)](*args, **kwargs)


@contextlib.contextmanager
def interpreted():
    """rollout/decode_attention.py's kernels in the interpreter while inside (the module docstring)."""
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}), \
            mock.patch.object(JITFunction, "__call__", _device_call), \
            mock.patch.object(decode_attention, "_split_kernel",
                              InterpretedFunction(decode_attention._split_kernel.fn)), \
            mock.patch.object(decode_attention, "_merge_kernel",
                              InterpretedFunction(decode_attention._merge_kernel.fn)):
        yield


def widen(bits_u16: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> the same numbers in fp32 (exact)."""
    return (np.asarray(bits_u16).astype(np.uint32) << 16).view(np.float32)


def round_bf16(x_f32: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, rounded to nearest even (NaN stays a quiet NaN)."""
    x_f32 = np.ascontiguousarray(x_f32, dtype=np.float32)
    u = x_f32.view(np.uint32).astype(np.uint64)  # no wrap-around in the rounding add
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x_f32), ((u >> 16) | 0x40).astype(np.uint16), rounded)


def _convert(src: TensorHandle, dst_type) -> TensorHandle | None:
    """The bf16 <-> fp32 conversion, or None for any other pair (the interpreter's own then)."""
    s, d = src.dtype.scalar, dst_type.scalar
    if s == tl.float32 and d == tl.bfloat16:
        return TensorHandle(round_bf16(src.data), d)
    if s == tl.bfloat16 and d == tl.float32:
        return TensorHandle(widen(src.data), d)
    return None


_cast_impl = InterpreterBuilder.cast_impl
_fp_to_fp = InterpreterBuilder.create_fp_to_fp
_dot = InterpreterBuilder.create_dot


def _exact_cast(self, src, dst_type):
    return _convert(src, dst_type) or _cast_impl(self, src, dst_type)


def _exact_fp_to_fp(self, src, dst_type, rounding_mode):
    return _convert(src, dst_type) or _fp_to_fp(self, src, dst_type, rounding_mode)


def _exact_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
        return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    a_data = widen(a.data) if a.dtype.scalar == tl.bfloat16 else a.data.astype(np.float32)
    b_data = widen(b.data) if b.dtype.scalar == tl.bfloat16 else b.data.astype(np.float32)
    return TensorHandle(np.matmul(a_data, b_data, dtype=d.data.dtype) + d.data, d.dtype.scalar)


@contextlib.contextmanager
def exact_bf16():
    """The interpreter's bf16 dot and casts made exact while inside (see the module docstring)."""
    with mock.patch.object(InterpreterBuilder, "cast_impl", _exact_cast), \
            mock.patch.object(InterpreterBuilder, "create_fp_to_fp", _exact_fp_to_fp), \
            mock.patch.object(InterpreterBuilder, "create_dot", _exact_dot):
        yield
