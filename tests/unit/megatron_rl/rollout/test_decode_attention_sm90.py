"""The Triton decode kernels (rollout/decode_attention.py) compile for sm90 (the H200) without a GPU,
for every constant set the GPU checks use: `triton.compile` with a `GPUTarget("cuda", 90, 32)`
runs the whole pipeline (TTIR, TTGIR, LLVM, PTX, ptxas) in bf16 and fp16, the dtypes the engine
enables it for, over the slot cache and over the paged cache's block table (pages of 16 positions,
the default and the paged GPU check's). triton is in the dev extras (the CPU wheel of torch comes
without it): this runs on every clean clone."""
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO as ROOT

# Compiled in a child: the kernels must be defined without TRITON_INTERPRET, whatever this process's
# environment says.
COMPILE = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_rl.rollout import decode_attention as da
from tools.bench_gpu import model_configs

INTS = ["s_qb", "s_qh", "s_tb", "s_ks", "s_kg", "s_kn", "s_vs", "s_vg", "s_vn", "s_ob", "s_oh", "s_os", "s_lb", "s_lh"]


def compile_(fn, signature, const):
    signature = {**signature, **dict.fromkeys(const, "constexpr")}
    names = list(signature)
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in const.items()})
    return len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"])


done = []
# The GPU checks' models; cache lengths: bench_gpu (16 + 32), gpu_decode_checks (64), --table (128, 1024 + 10).
for name, m in model_configs().items():
    for max_len, page in [(n, p) for n in (48, 64, 138, 1034) for p in (0, 16)]:
        const = da.constants(m.num_attention_heads, m.num_query_groups, m.kv_channels, max_len, page=page)
        for t in ("bf16", "fp16"):
            key = (t, tuple(sorted(const.items())))
            if key in done:
                continue
            sig = {"Q": f"*{t}", "K": f"*{t}", "V": f"*{t}", "Slot": "*i64", "Table": "*i64", "Len": "*i64",
                   "MidO": "*fp32", "MidL": "*fp32", "scale": "fp32", **dict.fromkeys(INTS, "i32")}
            assert compile_(da._split_kernel, sig, const) > 0
            merge = {"MidO": "*fp32", "MidL": "*fp32", "Out": f"*{t}",
                     **dict.fromkeys(["s_ob", "s_oh", "s_os", "s_lb", "s_lh", "s_xb", "s_xh"], "i32")}
            assert compile_(da._merge_kernel, merge, {"C": const["C"], "SPLITS": const["SPLITS"]}) > 0
            done.append(key)
print(json.dumps(len(done)))
'''


@pytest.mark.timeout(900)
def test_the_decode_kernels_compile_for_sm90_for_every_constant_set_the_checks_use():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env={**env, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + sys.path)}, capture_output=True, text=True, timeout=880)
    assert res.returncode == 0, res.stderr[-3000:]
    # 2 models x 2 dtypes x at least 2 cache lengths' constants, in slots and in pages
    assert int(res.stdout.split()[-1]) >= 16
