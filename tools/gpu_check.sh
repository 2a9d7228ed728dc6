#!/usr/bin/env bash
# The GPU path's checks on one H100/H200, within one time budget; one summary table at the end,
# correctness rows first. Exit status 1 if a correctness check failed or never reported, 3 if only
# speed rows did (their figures and targets are recorded either way), 0 otherwise; no row passes
# without evidence of what ran (docs/gpu.md, "The checks", and "A 15-minute visit" for the run plan):
#   bash tools/gpu_check.sh                                   # the default profile
#   FF_GPU_PROFILE=megatron-train bash tools/gpu_check.sh     # megatron-core and training
#   FF_GPU_PROFILE=slice bash tools/gpu_check.sh              # the 30B-A3B slice and its step table
#   FF_GPU_DRYRUN=1 bash tools/gpu_check.sh                   # every profile on CPU, tiny shapes (CI)
#   FF_GPU_STAGES='^(w|c): ' bash tools/gpu_check.sh         # only the stages whose names match (a rerun)
# Profiles and their stages: tools/gpu_timeline.py (with each stage's H200 time and the rows it
# reports); the bodies: tests/gpu/checks/ (gpu_checks.py, gpu_decode_checks.py, megatron_checks.py),
# tools/bench_gpu.py, tests/gpu/.
# - Wheels: the bare H200 lacks megatron-core and math-verify (+ two dependencies); the carried folder
#   $FF_GPU_WHEELS (default wheels/, filled by tools/gpu_wheels.sh) is installed first with
#   --no-index --no-deps. The dry run cannot install cp312 wheels: its import blocker
#   (tools/gpu_dryrun/sitecustomize.py) lets through only the image's modules and those of the wheels
#   in that folder, so a wheel left out fails the dry run as it would fail the GPU run.
# - Budget: FF_GPU_BUDGET_S (default 285 s, so 15 lent minutes hold a run and a rerun); each stage's
#   limit is cut to what is left; a stage with under 20 s left, or cut at its limit by the budget, and a
#   missing optional package (sglang, deepspeed) are SKIP rows with the reason, never FAIL. `timeout -k`
#   kills a stage's whole process group; the next stage waits until no GPU compute process remains.
# - Results: under ${OUT:-./gpu-out}: results.jsonl, gpu_check.log (everything printed),
#   gpu_step_times.json (the slice's step table), junit/ (the pytest stages' reports) and
#   gpu_md_section.md (docs/gpu.md's next Measured section); the last lines printed are the visit's
#   worst case, the compact table and the two verdicts.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
DRYRUN=${FF_GPU_DRYRUN:-0}
H200_BUDGET_S=${FF_GPU_BUDGET_S:-285}  # what the projected timeline is held to
# The budget this run's stages start within: the H200's, or in the dry run a CPU bound of its own
# (a 2-core CI machine is slower than an H200 at tiny shapes too).
BUDGET_S=$([[ $DRYRUN == 1 ]] && echo "${FF_GPU_DRYRUN_BUDGET_S:-1800}" || echo "$H200_BUDGET_S")
profiles=${FF_GPU_PROFILE:-$([[ $DRYRUN == 1 ]] && echo "default megatron-train slice" || echo default)}
for p in $profiles; do
    if ! python -c "import sys; from tools.gpu_timeline import PROFILES; sys.exit('$p' not in PROFILES)"; then
        echo "gpu_check: FF_GPU_PROFILE: unknown profile '$p', expected one of: $(python -c 'from tools.gpu_timeline import PROFILES; print(*PROFILES)')" >&2
        exit 2
    fi
done
if [[ $DRYRUN != 1 ]]; then
    ngpu=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
    if [[ $ngpu -eq 0 ]]; then
        echo "gpu_check: no CUDA device visible; run this on a GPU machine (or FF_GPU_DRYRUN=1 for the CPU dry run)" >&2
        exit 2
    fi
fi
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
export FF_GPU_WHEELS=${FF_GPU_WHEELS:-$PWD/wheels}
export FF_GPU_RESULTS=$OUT/results.jsonl
: >"$FF_GPU_RESULTS"
mkdir -p "$OUT/junit"
exec > >(tee "$OUT/gpu_check.log") 2>&1
tee_pid=$!

if [[ $DRYRUN == 1 ]]; then
    # What the bare image holds, nothing more; its pytest has no plugins to load.
    export FF_GPU_DRYRUN=1 PYTHONPATH=$PWD/tools/gpu_dryrun:$PYTHONPATH PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
    where="dry run on CPU ($(python -c 'import platform; print("Python", platform.python_version())'))"
else
    where="$ngpu x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
fi
echo "gpu_check: $(date -u +%FT%TZ), $where, profile(s) $profiles, budget ${BUDGET_S}s, results in $OUT;" \
     "$(python -c "import torch, transformers; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}')")"
for p in $profiles; do python tools/gpu_timeline.py "$p" --budget "$H200_BUDGET_S"; done

record() {  # record CHECK STATUS DETAIL SECONDS [--evidence NAME=N ...]
    python tools/gpu_summary.py "$FF_GPU_RESULTS" --record "$@"
}
junit() {  # the JUnit XML path of stage $1
    echo "$OUT/junit/$(echo "$1" | tr -c 'a-zA-Z0-9\n' '_').xml"
}
rows_of() {  # the rows stage $1 reports
    python tools/gpu_timeline.py --rows "$1"
}
fill() {  # fill STAGE STATUS DETAIL SECONDS: that status for each of the stage's rows not reported yet
    local rows
    mapfile -t rows < <(rows_of "$1")
    python tools/gpu_summary.py "$FF_GPU_RESULTS" --fill "$2" "$3" "$4" "${rows[@]}"
}
gpu_idle() {  # wait (up to 30 s) until no GPU compute process remains: a killed stage's ranks free memory
    command -v nvidia-smi >/dev/null || return 0
    for _ in $(seq 30); do
        [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null) ]] && return 0
        sleep 1
    done
    echo "== GPU compute processes remain after 30 s: $(nvidia-smi --query-compute-apps=pid,name --format=csv,noheader | tr '\n' ' ')"
}

# stage NAME LIMIT_S COMMAND...: run COMMAND within its limit and the budget. A command that records
# nothing itself has its single row recorded here on success: from pytest's JUnit XML with $JUNIT set
# (pass with the count of tests passed, skip when all were skipped), else $OWN as its detail with
# $EVIDENCE (NAME=N) as what ran.
stage() {
    local name=$1 limit=$2 start=$SECONDS rc left=$((BUDGET_S - SECONDS)) cut=0
    shift 2
    if [[ $left -lt 20 ]]; then
        echo "== $name: not run, ${left}s of the ${BUDGET_S}s budget left"
        fill "$name" skip "not run: ${left}s of the ${BUDGET_S}s budget (FF_GPU_BUDGET_S) left" 0
        return 1
    fi
    # The dry run's CPU is slower than an H200 even at tiny shapes (torch's import alone: 5-60 s on
    # a loaded 2-core machine): its stages get 6 times the limit, within its own budget.
    [[ $DRYRUN == 1 ]] && limit=$((limit * 6))
    ((limit > left)) && limit=$left cut=1
    gpu_idle
    echo "== $name (limit ${limit}s)"
    timeout -k 10 "$limit" "$@"
    rc=$?
    if [[ $rc -eq 0 && -n ${JUNIT:-} ]]; then
        python tools/gpu_summary.py "$FF_GPU_RESULTS" --junit "$name" "$JUNIT" $((SECONDS - start))
    elif [[ $rc -eq 0 && -n ${OWN:-} ]]; then
        record "$name" pass "$OWN" $((SECONDS - start)) --evidence "$EVIDENCE"
    elif [[ $rc -eq 124 || $rc -eq 137 ]] && ((cut)); then
        fill "$name" skip "cut at ${limit}s by the ${BUDGET_S}s budget (FF_GPU_BUDGET_S)" $((SECONDS - start))
    elif [[ $rc -ne 0 ]]; then
        fill "$name" fail "stage exit status $rc$([[ $rc -eq 124 || $rc -eq 137 ]] && echo ", over its ${limit}s limit")" \
            $((SECONDS - start))
    fi
    return "$rc"
}
dry() {  # the detail of a row recorded by this script: says "dry run" there
    if [[ $DRYRUN == 1 ]]; then echo "dry run (cpu, tiny): $1"; else echo "$1"; fi
}

pyt=(python -m pytest -q -rs -p no:cacheprovider -p no:warnings)
run_stage() {  # the stage NAME of a profile
    case $1 in
        "te: image guard")
            if [[ ${FLEXFLOOR_IMAGE:-} == h100 ]]; then
                OWN=$(dry "TransformerEngine, apex and megatron-core import (docker/smoke.py)") EVIDENCE="image smoke runs=1" \
                    stage "$1" 60 bash tools/te_image_guard.sh
            else
                record "$1" skip "not the H100 image (FLEXFLOOR_IMAGE unset): TransformerEngine is optional here" 0
            fi ;;
        "w: carried wheels")  # tools/gpu_wheels.sh records the row, the modules it imported and used as evidence
            stage "$1" 60 bash tools/gpu_wheels.sh --install "$FF_GPU_WHEELS" ;;
        "tests/gpu (c engine, b bf16)")
            stage "$1" 180 "${pyt[@]}" -m gpu tests/gpu/test_decode_engine_gpu.py ;;
        "tests/gpu (a, b)")
            stage "$1" 180 "${pyt[@]}" -m gpu tests/gpu/test_gpu_path.py ;;
        "c: bench small model")
            stage "$1" 120 python tools/bench_gpu.py --models small --batches 1 16 64 ;;
        "s: sglang lease")
            if python -c "import sglang" 2>/dev/null; then
                stage "$1" 120 "${pyt[@]}" -s tests/gpu/test_sglang_lease_gpu.py
            else
                record "s: sglang lease" skip "sglang is not installed here (optional: the sidecar lease)" 0
            fi ;;
        "m: logits vs torch backend")
            JUNIT=$(junit "$1") stage "$1" 90 "${pyt[@]}" -s --junitxml="$(junit "$1")" \
                tests/gpu/test_megatron_logits.py tests/gpu/test_megatron_te.py ;;
        "m: greedy generation")
            JUNIT=$(junit "$1") stage "$1" 60 "${pyt[@]}" -s --junitxml="$(junit "$1")" tests/gpu/test_megatron_generation.py ;;
        "m: 5 GRPO steps bf16")
            JUNIT=$(junit "$1") stage "$1" 90 "${pyt[@]}" -s --junitxml="$(junit "$1")" tests/gpu/test_megatron_grpo.py ;;
        "m: train backend=megatron, checkpoint + resume")
            stage "$1" 120 python tools/megatron_train_check.py ;;
        "m: decode tokens/s")
            stage "$1" 90 torchrun --standalone --nproc-per-node=1 tools/bench_megatron_backend.py \
                --layers 2 --vocab 32768 --batch 32 --new-tokens 32 ;;
        "tests/gpu (training)")
            stage "$1" 150 "${pyt[@]}" -s -m gpu tests/gpu/test_training_gpu.py ;;
        "c: bench 30B slice + step table")
            stage "$1" 150 python tools/bench_gpu.py --models 30b-slice --batches 1 64 --table "$OUT/gpu_step_times.json" ;;
        *) echo "gpu_check: no command for stage '$1' (tools/gpu_timeline.py)" >&2; return 2 ;;
    esac
}

expected=()
for p in $profiles; do
    mapfile -t names < <(python -c "from tools.gpu_timeline import PROFILES; print('\n'.join(PROFILES['$p']))")
    for name in "${names[@]}"; do
        [[ $name =~ ${FF_GPU_STAGES:-.} ]] || continue
        mapfile -t -O "${#expected[@]}" expected < <(rows_of "$name")
        if [[ $name == m:* ]] && ! python -c "import megatron.core" 2>/dev/null; then
            fill "$name" skip "megatron-core does not import here (see the w: carried wheels row; docs/gpu.md)" 0
            continue
        fi
        run_stage "$name"
    done
done

echo
python tools/gpu_timeline.py default --budget "$H200_BUDGET_S" | tail -n 1 | sed 's/^ */default profile, projected on an H200: /'
python tools/gpu_timeline.py --visit --budget "$H200_BUDGET_S" || visit_status=1
python tools/gpu_summary.py "$FF_GPU_RESULTS" --expect "${expected[@]}" --markdown "$OUT/gpu_md_section.md" \
    --title "\`$([[ $DRYRUN == 1 ]] && echo "FF_GPU_DRYRUN=1 ")bash tools/gpu_check.sh\`, $(date -u +%FT%TZ), $where, profile(s) $profiles"
status=$?
# A plan whose worst case overruns the visit fails the run (the dry run says so before any GPU time).
((status == 0 && ${visit_status:-0})) && status=1
exec >&- 2>&-
wait "$tee_pid"
exit "$status"
