#!/usr/bin/env bash
# The megatron backend's GPU checks, for a machine with H100/H200s (or the H100 image):
#   bash tools/gpu_check.sh [BENCH FLAGS...]     # flags go to tools/bench_megatron_backend.py
# 1. backend equality: torch vs megatron backend, same weights, logits within bf16 tolerance
#    (tests/distributed/test_megatron_gpu.py);
# 2. decode tokens/s of both backends side by side and the megatron backend's EP shrink latency
#    (tools/bench_megatron_backend.py, one rank per visible GPU).
# Without TransformerEngine both run megatron-core's SequentialMLP experts and say so.
# Then the sglang sidecar lease on this GPU (tests/gpu/; skipped where sglang is not installed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

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

echo "== 1/2 backend equality (torch vs megatron, bf16)"
timeout 600 python -m pytest -q -s -rs -p no:cacheprovider tests/distributed/test_megatron_gpu.py

echo "== 2/2 decode tokens/s and shrink latency on $ngpu GPU(s)"
timeout 600 torchrun --standalone --nproc-per-node="$ngpu" tools/bench_megatron_backend.py "${bench_flags[@]}" "$@"

echo "== sglang sidecar lease (skipped where sglang is not installed: see docker/README.md)"
timeout 600 python -m pytest -q -s -rs -p no:cacheprovider tests/gpu/
