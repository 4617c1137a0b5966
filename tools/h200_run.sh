#!/usr/bin/env bash
# One call on the lent H200 (device tool): GPU smoke test, tree/decoding checks on the GPU, kernel
# checks, and the Qwen3-8B-shape benchmark. Everything lands under $OUT; each step has its own time limit
# so one slow step cannot eat the others. Usage (from the repo root): bash tools/h200_run.sh [steps...]
set -uo pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
steps="${*:-smoke tests kernels bench}"
log() { echo "== $* ($(date +%H:%M:%S))"; }
# Each step writes its own log under $OUT (what is there comes back even if the call is cut short);
# keep the sum of the steps' limits under the device call's 600 s.

for step in $steps; do
  case "$step" in
    smoke)
      log smoke
      nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
      python3 -c "import jax, flax, orbax.checkpoint as o; print(jax.__version__, flax.__version__, o.__version__, jax.devices())"
      timeout 180 python3 -m ddtree_jax.generate --prompt "def f(x):" --json --max-new-tokens 24 --ignore-eos \
        --dtype float32 > "$OUT/smoke.json" 2> "$OUT/smoke.err"; echo "rc=$?"; cat "$OUT/smoke.json"
      ;;
    tests)
      log "tree + decoding tests on the GPU (float32)"
      timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_ddtree_decoding.py \
        -k "greedy or transfers" > "$OUT/tests.log" 2>&1; tail -3 "$OUT/tests.log"
      timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/gpu_tests.log" 2>&1
      tail -3 "$OUT/gpu_tests.log"
      ;;
    kernels)
      log kernels
      if [ -f pallas_kernels/gpu_check.py ]; then
        timeout "${KERNEL_LIMIT:-200}" python3 -m pallas_kernels.gpu_check --out "$OUT/kernels" > "$OUT/kernels.log" 2>&1
        tail -40 "$OUT/kernels.log"
      fi
      ;;
    bench)
      log "bench qwen3-8b"
      timeout "${BENCH_LIMIT:-480}" python3 -m ddtree_jax.bench --shape qwen3-8b --context 2048 \
        --budgets "${BUDGETS:-16,64,256,512}" --modes "${MODES:-ar,dflash,ddtree}" --repeats "${REPEATS:-10}" \
        --out "$OUT/bench" > "$OUT/bench.log" 2>&1; tail -20 "$OUT/bench.log"
      ;;
  esac
done
log done
