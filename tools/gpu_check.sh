#!/usr/bin/env bash
# The megatron backend's GPU checks, for a machine with H100/H200s (or the H100 image):
#   bash tools/gpu_check.sh [BENCH FLAGS...]     # flags go to tools/bench_megatron_backend.py
# 0. in the H100 image, TransformerEngine must import (tools/te_image_guard.sh): no silent fallback;
# 1. the megatron backend's checks (tests/gpu/test_megatron_*.py): logits and greedy tokens against
#    the torch backend, TE layer weights and attention, gradients and 5 GRPO steps, and (2 GPUs) the
#    elastic rollout against vanilla;
# 2. decode tokens/s of both backends side by side and the megatron backend's EP shrink latency
#    (tools/bench_megatron_backend.py, one rank per visible GPU).
# Without TransformerEngine both run megatron-core's SequentialMLP experts and say so.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

bash tools/te_image_guard.sh

ngpu=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [[ $ngpu -eq 0 ]]; then
    echo "gpu_check: no CUDA device visible; run this on a GPU machine" >&2
    exit 2
fi
bench_flags=()
if python -c "import transformer_engine.pytorch" 2>/dev/null; then
    te="TransformerEngine $(python -c "from importlib.metadata import version; print(version('transformer_engine'))")"
else
    te="no TransformerEngine: megatron-core SequentialMLP experts instead of grouped GEMM"
    bench_flags+=(--no-grouped-gemm)
fi
echo "gpu_check: $ngpu x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1);" \
     "torch $(python -c "import torch; print(torch.__version__)"), $te"

echo "== 1/2 megatron backend: logits, greedy tokens, TE layer, gradients, GRPO steps, elastic (bf16)"
timeout 600 python -m pytest -q -s -rs -p no:cacheprovider tests/gpu/test_megatron_logits.py \
    tests/gpu/test_megatron_generation.py tests/gpu/test_megatron_te.py tests/gpu/test_megatron_grpo.py \
    tests/gpu/test_megatron_elastic.py

echo "== 2/2 decode tokens/s and shrink latency on $ngpu GPU(s)"
timeout 600 torchrun --standalone --nproc-per-node="$ngpu" tools/bench_megatron_backend.py "${bench_flags[@]}" "$@"
