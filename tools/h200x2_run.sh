#!/usr/bin/env bash
# The two-GPU run (device kind nvidia-h200-x2), one step per device call (each under its 600 s). Usage, from the
# repo root: bash tools/h200x2_run.sh [STEP...] (default: qwen3). NCCL's NVLink multicast stays off (see the
# device tool's KINDS.md). Logs and JSON under $OUT.
#   qwen3            tp/dp greedy equality against one GPU on random Qwen3-8B-shaped weights, then the
#                    benchmark single / tp=2 / dp=2
#   hybrid_tp        the benchmark of the Qwen3.6-27B hybrid shape split over both GPUs (--parallel tp: the
#                    Gated DeltaNet layers by key heads), AR and DDTree      -> bench_qwen3.6-27b_tp/
#   hybrid_single    the same on one of the GPUs, for the speedup on the same machine -> bench_qwen3.6-27b_single/
#   hybrid_equality  greedy AR / DFlash / DDTree on random Qwen3.6-27B weights: tp=2 against one GPU
set -uo pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda NCCL_NVLS_ENABLE=0
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
hybrid_bench() {  # $1: single or tp
  local flags=""; [ "$1" = tp ] && flags="--devices 2 --parallel tp"
  # shellcheck disable=SC2086
  timeout "${HYBRID_LIMIT:-420}" python3 -m ddtree_jax.bench --shape qwen3.6-27b --context 2048 \
    --budgets "${HYBRID_BUDGETS:-16,64}" --modes ar,ddtree --repeats 5 --kernels pallas $flags \
    --out "$OUT/bench_qwen3.6-27b_$1" > "$OUT/bench_qwen3.6-27b_$1.log" 2>&1; echo "rc=$?"
  grep -v '^{"mode"' "$OUT/bench_qwen3.6-27b_$1.log" | tail -8
}
for step in "${@:-qwen3}"; do
  echo "== $step ($(date +%H:%M:%S))"
  case "$step" in
    qwen3)
      timeout 150 python3 tools/tp_equality.py --devices 2 --parallel tp > "$OUT/tp_equality.log" 2>&1; tail -4 "$OUT/tp_equality.log"
      for par in single tp dp; do
        flags=""; [ "$par" != single ] && flags="--devices 2 --parallel $par"
        timeout 140 python3 -m ddtree_jax.bench --shape qwen3-8b --context 2048 --budgets 64,256 --repeats 5 \
          $flags --out "$OUT/bench_$par" > "$OUT/bench_$par.log" 2>&1; tail -6 "$OUT/bench_$par.log"
      done
      ;;
    hybrid_tp) hybrid_bench tp ;;
    hybrid_single) hybrid_bench single ;;
    hybrid_equality)
      timeout "${EQUALITY_LIMIT:-540}" python3 tools/tp_equality.py --shape qwen3.6-27b --devices 2 --parallel tp \
        --max-new-tokens 16 --budget 16 > "$OUT/tp_equality_qwen3.6-27b.log" 2>&1; echo "rc=$?"
      tail -4 "$OUT/tp_equality_qwen3.6-27b.log"
      ;;
    *)
      echo "unknown step $step"; exit 2 ;;
  esac
done
