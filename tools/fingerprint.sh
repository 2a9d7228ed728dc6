#!/usr/bin/env bash
# The behaviour fingerprint a refactor must keep byte-identical (compare two with `diff -r A B`):
#   rollout/   responses_sha256 of the demo and of one 4-rank CLI rollout per policy (float64, greedy)
#   simulate/  `flexfloor simulate --json` for every simulated policy (and TailGuard, the megatron
#              backend, leases, migration) on four traces from tools/make_trace.py
#   train/     3-step trains: losses, rewards and every other non-timing metric, and the sha256 of the
#              exported weights, of the tiny GRPO example as shipped, of it with routing replay, KL,
#              masked IS, partial rollouts and the slot cache, and of the megatron backend through the
#              CPU harness (tests/megatron_site)
# Usage: bash tools/fingerprint.sh OUT_DIR [rollout|simulate|train ...]   (all three by default)
set -euo pipefail
out=${1:?usage: tools/fingerprint.sh OUT_DIR [rollout|simulate|train ...]}
shift
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(rollout simulate train)
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ff() { python -m megatron_rl.cli "$@"; }
sha() { python -c 'import json,sys; print(json.load(open(sys.argv[1]))["responses_sha256"])' "$1"; }

for part in "${parts[@]}"; do
  case "$part" in
  rollout)
    mkdir -p "$out/rollout"
    # the demo prints its sha256's first 16 hex digits (its --json is not written)
    ff demo --quiet | grep -o 'identical responses: .* (sha256 [0-9a-f]*' > "$out/rollout/demo.sha256"
    for p in vanilla lengthsort natural planned adaptive; do
      ff rollout --ranks 4 --policy "$p" --device cpu --quiet --json "$work/$p.json" >/dev/null
      sha "$work/$p.json" > "$out/rollout/$p.sha256"
    done ;;
  simulate)
    mkdir -p "$out/simulate"
    python tools/make_trace.py --preset deepscaler --seed 1 --out "$work/deepscaler1.jsonl" >/dev/null
    python tools/make_trace.py --preset deepscaler --seed 2 --out "$work/deepscaler2.jsonl" >/dev/null
    python tools/make_trace.py --preset eurus --seed 1 --out "$work/eurus1.jsonl" >/dev/null
    python tools/make_trace.py --preset nosignal --seed 1 --out "$work/nosignal1.jsonl" >/dev/null
    for t in deepscaler1 deepscaler2 eurus1 nosignal1; do
      for v in "vanilla" "lengthsort" "natural" "planned" "oracle" "adaptive" "planned --tailguard" \
               "planned --backend megatron" "planned --lease" "planned --migrate 8"; do
        name=$(echo "$v" | tr ' ' '_' | tr -d '-')
        # shellcheck disable=SC2086
        ff simulate --trace "$work/$t.jsonl" --policy $v --json > "$out/simulate/$t.$name.json"
      done
    done ;;
  train)
    mkdir -p "$out/train"
    keep='import json,sys,re
skip = re.compile(r"^(timing|perf/|elastic/|lease/|rollout/engine)|_s$|time")
for line in open(sys.argv[1]):
    d = json.loads(line)
    print(json.dumps({k: v for k, v in sorted(d.items()) if not skip.search(k)}))'
    run_train() {  # name, extra args...
      local name=$1; shift
      ff train --config examples/tiny_cpu_grpo.yaml --steps 3 --out "$work/$name" logging.wandb_mode=disabled "$@" >/dev/null
      python -c "$keep" "$work/$name/metrics.jsonl" > "$out/train/$name.metrics"
      (cd "$work/$name/hf" && sha256sum model*.safetensors) > "$out/train/$name.weights.sha256"
    }
    run_train shipped
    run_train options grpo.routing_replay=true grpo.kl_coef=0.01 'grpo.mis_bounds=[0.5,2.0]' \
      partial.enabled=true generation.kv=slots
    PYTHONPATH="$PWD/tests/megatron_site${PYTHONPATH:+:$PYTHONPATH}" \
      run_train megatron --ranks 2 backend=megatron dtype=float32 grpo.kl_coef=0.0 ;;
  *) echo "fingerprint: unknown part $part (rollout, simulate or train)" >&2; exit 2 ;;
  esac
done
echo "fingerprint written to $out"
