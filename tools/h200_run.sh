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
# demo_bg starts the demo training (python -m ddtree_jax.train.demo) in its own process session on GPU
# $DEMO_GPU, so it outlives this call while the machine stays warm; demo_pack, in a later call on the
# same machine, waits for it (at most $DEMO_WAIT s) and splits the result into <= 15 MB parts under $OUT.

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
      # Per-layer timing over issue 5's grid (36 layers in one program) + correctness; not yet run on an H200:
      # estimated 3-4 min; KERNEL_ARGS=--quick for about a minute. gpu_check.json/.md are rewritten after every
      # point, so a run cut by the limit keeps what it finished.
      if [ -f pallas_kernels/gpu_check.py ]; then
        # shellcheck disable=SC2086
        timeout "${KERNEL_LIMIT:-300}" python3 -m pallas_kernels.gpu_check --out "$OUT/kernels" ${KERNEL_ARGS:-} \
          > "$OUT/kernels.log" 2>&1; echo "rc=$?"
        tail -48 "$OUT/kernels.log"
      fi
      ;;
    demo_bg)
      log "demo training in the background on GPU ${DEMO_GPU:-1}"
      CUDA_VISIBLE_DEVICES="${DEMO_GPU:-1}" setsid nohup python3 -m ddtree_jax.train.demo --out /tmp/demo \
        > /tmp/demo.log 2>&1 < /dev/null &
      ;;
    demo_pack)
      log "waiting for the demo training"
      for _ in $(seq "${DEMO_WAIT:-300}"); do [ -f /tmp/demo/summary.json ] && break; sleep 1; done
      cp /tmp/demo.log "$OUT/demo.log"; tail -5 /tmp/demo.log
      if [ -f /tmp/demo/summary.json ]; then
        tar -C /tmp -cf - --exclude=checkpoints demo | split -b 15M - "$OUT/demo.tar.part-"; ls -la "$OUT"
      fi
      ;;
    bench)
      log "bench qwen3-8b"
      timeout "${BENCH_LIMIT:-480}" python3 -m ddtree_jax.bench --shape qwen3-8b --context 2048 \
        --budgets "${BUDGETS:-16,64,256,512}" --modes "${MODES:-ar,dflash,ddtree}" --repeats "${REPEATS:-10}" \
        --kernels "${KERNELS:-jax,pallas}" \
        --out "$OUT/bench" > "$OUT/bench.log" 2>&1; tail -20 "$OUT/bench.log"
      ;;
  esac
done
log done
