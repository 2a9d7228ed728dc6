#!/usr/bin/env bash
# The GPU path's checks on one (or more) H100/H200, with a stock PyTorch+CUDA Python; one summary
# table at the end, exit status 1 if any check failed or never reported (docs/gpu.md):
#   bash tools/gpu_check.sh
# (a) tests/gpu: a small Qwen3-MoE (4 layers, hidden 512, 64 experts, top-8) in bf16 on one GPU:
#     greedy tokens vs a float64 CPU reference on the same weights, and 5 GRPO steps that must lower
#     the loss on their own batch;
# (b) tests/gpu: a 2-rank elastic rollout on ONE GPU over the host-staged gloo transport (shrink,
#     expert moves, restore, checksums; responses' sha256 equal to vanilla);
# (b, bf16) tests/gpu/test_decode_engine_gpu.py: every policy in bf16 on 2 ranks sharing the GPU, the share
#     of responses identical to vanilla's and the reward difference (natural floor 1 must equal vanilla);
# (c) tools/bench_gpu.py: decode of our engine eager and graphed vs HF transformers `generate` (small model
#     and a Qwen3-30B-A3B-shaped 4-layer slice; batches 1, 16, 64, 256; kernels per step, roofline share;
#     the slice's step-time table and its cost-model fit into gpu_step_times.json), and
#     tests/gpu/test_decode_engine_gpu.py: decode steps under set_sync_debug_mode("error"), graph
#     replay = eager tokens, re-capture after KV release/reclaim and an expert move (docs/rollout.md);
# (m) the megatron backend's checks (tests/gpu/test_megatron_*.py: logits and greedy tokens against the
#     torch backend, TE layer weights and attention, gradients and 5 GRPO steps;
#     tools/megatron_train_check.py: `flexfloor train backend=megatron device=cuda` with a checkpoint
#     and a resume; tools/bench_megatron_backend.py: decode tokens/s, GroupedMM vs SequentialMLP vs
#     the torch backend), installing megatron-core from the wheel folder $FF_MEGATRON_WHEELS when it
#     does not import, skipped with the reason when it still does not; in the H100 image a
#     TransformerEngine that does not import fails the run (tools/te_image_guard.sh);
# (s) the sglang sidecar lease on this GPU (tests/gpu/test_sglang_lease_gpu.py; skipped where sglang
#     is not installed).
# Stages run in that order of priority ((c), (m), training, (a, b), (s)) within one time budget,
# FF_GPU_BUDGET_S (default 285 s): a stage that would start with under 20 s left is a failed row.
# Installs nothing but a carried megatron-core wheel (above); needs torch with CUDA, transformers, pytest and pytest-timeout (`pip install -e '.[dev]'`).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

ngpu=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [[ $ngpu -eq 0 ]]; then
    echo "gpu_check: no CUDA device visible; run this on a GPU machine" >&2
    exit 2
fi
FF_GPU_RESULTS=$(mktemp --suffix=.jsonl)
export FF_GPU_RESULTS
echo "gpu_check: $(date -u +%FT%TZ), $ngpu x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)," \
     "$(python -c "import torch, transformers; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}')")"

record() {  # record CHECK STATUS DETAIL SECONDS
    python tools/gpu_summary.py "$FF_GPU_RESULTS" --record "$@"
}

# The whole script's time budget: a lent GPU's minutes are few, so every stage's limit is cut to
# what is left of it, and a stage with under 20 s left is not started (a failed row naming the
# budget). Stages run in priority order: the decode engine and megatron rows first.
BUDGET_S=${FF_GPU_BUDGET_S:-285}

# stage NAME LIMIT_S COMMAND...: run COMMAND under a time limit; a failing stage is a row of the table
# (its own checks, if any, have recorded theirs already).
stage() {
    local name=$1 limit=$2 start=$SECONDS rc left=$((BUDGET_S - SECONDS))
    shift 2
    if [[ $left -lt 20 ]]; then
        echo "== $name: not run, ${left}s of the ${BUDGET_S}s budget left"
        record "$name" fail "not run: ${left}s of the ${BUDGET_S}s budget (FF_GPU_BUDGET_S) left" 0
        return 1
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@"
    rc=$?
    if [[ $rc -ne 0 ]]; then
        record "$name" fail "exit status $rc$([[ $rc -eq 124 ]] && echo ", over its ${limit}s limit")" $((SECONDS - start))
    fi
    return "$rc"
}

stage "te: image guard" 120 bash tools/te_image_guard.sh
stage "tests/gpu (b bf16, c engine)" 180 python -m pytest -q -rs -p no:cacheprovider -m gpu \
    tests/gpu/test_decode_engine_gpu.py
stage "c: tools/bench_gpu.py" 150 python tools/bench_gpu.py --batches 1 16 64 --table gpu_step_times.json
expected=("a: greedy bf16 vs fp64 CPU" "a: 5 GRPO steps bf16" "b: 2-rank elastic, one GPU"
          "c: decode tokens/s, batch 1" "c: decode tokens/s, batch 64"
          "b: bf16 responses per policy vs vanilla" "c: decode step, sync debug mode error"
          "c: graph replay = eager tokens (bf16)" "c: 30B-A3B slice step vs roofline, batch 64"
          "c: graphed tokens = eager tokens")

# (m) the megatron backend (issue 20), ~90 s. A machine without megatron-core (the lent H200) gets
# it from a carried wheel: $FF_MEGATRON_WHEELS names a folder holding megatron_core-0.16.1-*.whl
# (docs/gpu.md: how to fetch it); installed without an index or dependencies (torch, numpy and
# packaging are there already).
if ! python -c "import megatron.core" 2>/dev/null && [[ -n ${FF_MEGATRON_WHEELS:-} ]]; then
    echo "== m: installing megatron-core 0.16.1 from $FF_MEGATRON_WHEELS"
    python -m pip install -q --no-index --no-deps --find-links "$FF_MEGATRON_WHEELS" "megatron-core==0.16.1" \
        || record "m: megatron-core wheel" fail "pip install --find-links $FF_MEGATRON_WHEELS failed" 0
fi
mstage() {  # mstage NAME LIMIT_S COMMAND...: a stage that records its own pass
    local name=$1 start=$SECONDS
    stage "$@" && record "$name" pass "${MDETAIL:-}" $((SECONDS - start))
}
if python -c "import megatron.core" 2>/dev/null; then
    pyt=(python -m pytest -q -s -rs -p no:cacheprovider)
    MDETAIL="both dispatchers, bf16, vs fp32 reference" mstage "m: logits vs torch backend" 60 \
        "${pyt[@]}" tests/gpu/test_megatron_logits.py tests/gpu/test_megatron_te.py
    MDETAIL="see the agreement line above" mstage "m: greedy generation" 45 "${pyt[@]}" tests/gpu/test_megatron_generation.py
    MDETAIL="grads vs torch backend; DDP + DistributedOptimizer" mstage "m: 5 GRPO steps bf16" 60 \
        "${pyt[@]}" tests/gpu/test_megatron_grpo.py
    stage "m: train backend=megatron, checkpoint + resume" 120 python tools/megatron_train_check.py
    stage "m: decode tokens/s" 120 torchrun --standalone --nproc-per-node=1 tools/bench_megatron_backend.py \
        --layers 2 --vocab 32768 --batch 32 --new-tokens 32
    expected+=("m: logits vs torch backend" "m: greedy generation" "m: 5 GRPO steps bf16"
               "m: train backend=megatron, checkpoint + resume" "m: decode tokens/s, GroupedMM"
               "m: decode tokens/s, SequentialMLP")
else
    record "m: megatron backend" skip "megatron-core is not importable here (set FF_MEGATRON_WHEELS: docs/gpu.md)" 0
fi

# issue 21: bf16 vs fp32 GRPO updates on the same rollouts (per-update table), offloaded optimizer step
stage "tests/gpu (training)" 300 python -m pytest -q -s -rs -p no:cacheprovider -m gpu tests/gpu/test_training_gpu.py
expected+=("a: bf16 GRPO per-update table")
stage "tests/gpu (a, b)" 300 python -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu/test_gpu_path.py
stage "s: sglang lease" 300 python -m pytest -q -s -rs -p no:cacheprovider tests/gpu/test_sglang_lease_gpu.py

echo
python tools/gpu_summary.py "$FF_GPU_RESULTS" --expect "${expected[@]}"
