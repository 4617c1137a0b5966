#!/usr/bin/env bash
# The two-GPU run (device kind nvidia-h200-x2): tp/dp greedy equality against one GPU on random
# Qwen3-8B-shaped weights, then the benchmark single / tp=2 / dp=2 in the same call. NCCL's NVLink
# multicast stays off (see the device tool's KINDS.md). Logs and JSON under $OUT.
set -uo pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda NCCL_NVLS_ENABLE=0
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 150 python3 tools/tp_equality.py --devices 2 --parallel tp > "$OUT/tp_equality.log" 2>&1; tail -4 "$OUT/tp_equality.log"
for par in single tp dp; do
  flags=""; [ "$par" != single ] && flags="--devices 2 --parallel $par"
  timeout 140 python3 -m ddtree_jax.bench --shape qwen3-8b --context 2048 --budgets 64,256 --repeats 5 \
    $flags --out "$OUT/bench_$par" > "$OUT/bench_$par.log" 2>&1; tail -6 "$OUT/bench_$par.log"
done
