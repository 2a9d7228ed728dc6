#!/usr/bin/env bash
# The wheels a bare H200 image lacks (tools/gpu_wheels.txt: megatron-core, math-verify and its two
# dependencies, about 3 MB), for Python 3.12 and manylinux x86_64, without dependencies:
#   bash tools/gpu_wheels.sh [DIR]             # download them into DIR (default wheels/; needs internet)
#   bash tools/gpu_wheels.sh --install DIR     # on the GPU machine: install them, then import and use each
# wheels/ is git-ignored: carry it to the lent machine (docs/gpu.md, "The lent machine").
# tools/gpu_check.sh runs --install as its row `w: carried wheels` (recorded here);
# in its dry run (FF_GPU_DRYRUN=1, another Python) nothing is installed and the import blocker stands
# for the folder's wheels.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ ${1:-} == --install ]]; then
    dir=${2:?usage: gpu_wheels.sh --install DIR}
    mapfile -t whl < <(find "$dir" -maxdepth 1 -name '*.whl' 2>/dev/null)
    if [[ ${FF_GPU_DRYRUN:-0} != 1 && ${#whl[@]} -gt 0 ]]; then
        python -m pip install -q --no-index --no-deps "${whl[@]}"
    fi
    # The row `w: carried wheels` (with $FF_GPU_RESULTS set), its evidence the modules imported and used.
    python - "${#whl[@]}" <<'PY'
import sys
import time

from megatron_rl.rewards.math_answer import verify_math  # math-verify: training's math reward
from tools.gpu_env import DRYRUN, dryrun_detail
from tools.gpu_summary import record

t0 = time.perf_counter()
assert verify_math("so the answer is \\boxed{4}", "4") == "correct"
import megatron.core  # noqa: E402, F401  the m: rows

wheels = int(sys.argv[1])
record("w: carried wheels", "pass",
       dryrun_detail(f"{wheels} wheel(s) {'named' if DRYRUN else 'installed'}; megatron-core and "
                     "math-verify import, math-verify verified one answer"),
       time.perf_counter() - t0, evidence={"modules imported and used": 2})
print("gpu_wheels: megatron-core and math-verify import; math-verify verified one answer")
PY
    exit 0
fi
dest=${1:-wheels}
mkdir -p "$dest"
grep -v '^#' tools/gpu_wheels.txt | while read -r req _module; do
    [[ -n $req ]] || continue
    # manylinux_2_28 (the H200 image's glibc is newer) also admits every older manylinux tag; the
    # megatron-core wheel is tagged 2_24/2_28 only, so a 2_17/2014 platform never found it.
    python -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d "$dest" "$req"
done
ls -l "$dest"
