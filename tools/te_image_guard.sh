#!/usr/bin/env bash
# TE-in-image guard for tools/gpu_check.sh (call it first; it exits non-zero on failure):
#   bash tools/te_image_guard.sh
# In the H100 image (FLEXFLOOR_IMAGE=h100, set by docker/Dockerfile.h100) TransformerEngine, apex and
# megatron-core must import against the torch they were built for (docker/smoke.py): a missing or
# broken TransformerEngine fails the check instead of letting the megatron backend fall back to
# megatron-core's SequentialMLP experts. Outside the image TransformerEngine is optional.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ ${FLEXFLOOR_IMAGE:-} == h100 ]]; then
    python docker/smoke.py || { echo "te_image_guard: the H100 image is broken (see above); rebuild it with docker/build.sh h100" >&2; exit 1; }
else
    echo "te_image_guard: not in the H100 image (FLEXFLOOR_IMAGE unset); TransformerEngine is optional here"
fi
