#!/usr/bin/env bash
# One bounded call on the lent H200 (device tool). Usage, from the repo root:
#   set -o pipefail; bash tools/h200_run.sh STEP... 2>&1 | tee $OUT/run.log
# Steps (each with its own time limit, so one slow step cannot eat the others; keep their sum under the
# call's 600 s; at most 8 files come back, so every step writes few):
#   smoke     GPU, versions
#   probe     tools/gpu_probe.py: bandwidth ceilings and the projections of 36 Qwen3-8B layers  -> probe.json
#   bench     python -m ddtree_jax.bench --shape qwen3-8b (AR, DFlash, DDTree 16..512; pallas and jax),
#             with a profiler trace of every row, summarised ($TRACE_TOP kernel names)  -> bench/, traces.tar,
#             trace_summary.json
#   equality  tools/greedy_equality.py in bf16 with the default kernels: random 8B weights, the demo pair
#   kernels   tools/kernel_check.py (per-layer attention/acceptance timing and checks) -> kernels/
#   tests     the GPU-marked tests and the greedy DDTree decoding tests, compiled on the GPU
#   hybrid    python -m ddtree_jax.bench --shape qwen3.6-27b                        -> hybrid/
#   bench_ab  the bench ($AB_SHAPE: qwen3-8b, $AB_MODES, $AB_BUDGETS, pallas) at a baseline tree ($BASELINE, e.g. a `git archive` of an
#             older commit, carried) and at this one (with $AB_TREE_RULE, the tree rule's knobs as tools/with_tree_rule.py
#             takes them), with traces of this one's rows summarised -> ab/
#   tree      tools/topk_probe.py: the tree build (and its vocabulary top-k) against $BASELINE's tree.py -> tree/
#   build     the tree-build and vocabulary top-k kernels compiled (their GPU tests), then tools/topk_probe.py: XLA
#             builder against the kernel and its $BUILD_KERNELS knob variants, with the vocabulary top-ks of
#             $BUILD_TOP_K (and alone), $BUILD_VOCAB x $BUILD_BUDGETS                          -> build/
#   hlo       the bench ($HLO_SHAPE: qwen3-8b, $HLO_MODES, DDTree $HLO_BUDGETS, pallas) traced, with XLA's optimised
#             HLO dumped: which fusion each kernel of a round is                      -> hlo.tar.xz, hlo_traces.tar
#   xla       the bench ($XLA_SHAPE: qwen3-8b, $XLA_MODES: AR, DFlash, DDTree $XLA_BUDGETS, pallas, traced) under each
#             XLA_FLAGS variant of $XLA_VARIANTS (e.g. split-K forced off: its final reductions no longer fuse into
#             the Pallas kernels after the GEMMs)                                              -> xla/v1, xla/v2, ...
#   ncu       Nsight Compute (--set full: stall reasons, source counters) on the tree attention and its merge
#             (tools/attention_once.py) at T = $NCU_T
#                                                                                          -> ncu_t65.txt, ...
#   demo_trace  the bench at the demo pair's shape (random weights), AR, DFlash, DDTree $DEMO_SHAPE_BUDGETS, with
#             traces summarised: where a small model's round goes           -> demo_shape/, demo_trace_summary.json
#   matmul    tools/gpu_probe.py projections at T = 1..128 ($MATMUL_FORMS, streaming configs in $MATMUL_ARGS), and the
#             $MATMUL_VARIANT_FORMS (hf) under each further XLA_FLAGS variant of $MATMUL_VARIANTS  -> matmul/
#   sweeps    the bench at qwen3-8b over --batch $SWEEP_BATCH (1,4,16; context 2048) and --context $SWEEP_CONTEXT
#             (8192,32768; batch 1), AR, DFlash and DDTree $SWEEP_BUDGETS (15,64), pallas; $SWEEPS (batch context):
#             one a call, each within $SWEEP_LIMIT (500) s                              -> sweep_batch/, sweep_context/
#   float32   the float32 GPU tests (float64 reference) and the float32 AR/DDTree cost at --matmul-precision
#             highest and default                                                        -> f32_highest/, f32_default/
#   loop_cost what a decode-loop call costs beyond its rounds (tools/loop_cost.py; $LOOP_ARGS), with XLA's default
#             flags and each XLA_FLAGS variant of $LOOP_COST_XLA (';'-separated)             -> loop_cost/
#   gdn       tools/gdn_probe.py: the hybrid's Gated DeltaNet tree rule and its triangular solve per layer, solve
#             variants ($GDN_ARGS, e.g. --t 16,65 --solves trsm,blocked16)                       -> gdn/
#   bitwise   tools/bitwise_probe.py: which parts of a Qwen3-8B forward give a row other bits in a T-row call than
#             alone (issue 20), bf16, T = $BITWISE_T, parts $BITWISE_PARTS (all)  -> bitwise/
#   kernel_tests  the GPU tests of the kernels changed last ($KERNEL_TESTS) and the hybrid engine with the Pallas
#             kernels, compiled (the greedy DDTree decoding tests are the `tests` step's)
#   wide_defaults  issue 19: the top-k and build kernels' GPU tests, the build at B = 128, 256, 512 (deep, i.i.d.), XLA's
#             builder against the kernel, with the defaults above 128 of 2026-12-06 (gathered top-k, split selection;
#             wider tiles, merge by search, the bisection above B), then the 8B DDTree rounds at B = 256, 512 with the
#             kernels and without                                     -> wide_peak{0,20}/, wide_{xla,kernels}/
#   build_ncu issue 19: Nsight Compute on the tree-build kernel (deep trees, V = 151936, B = $NCU_BUDGETS): its report,
#             the details page and the source page (warp stall samples per SASS instruction; XLA's Triton writes no
#             line table, so match them to source lines offline: tools/triton_offline.py --by-line)
#                                                                    -> ncu_build_b*.ncu-rep, .txt, _source.csv
#   knobs_rounds  the demo pair's rounds (tools/loop_cost.py) and end to end (the bench, 32 prompts x 128) at the
#             defaults and with each ';'-separated set of $KNOBS (tools/with_knobs.py items, space-separated)
#                                                                          -> lc_{0,1,..}.json, demo_{0,1,..}/bench.json
#   fp8_tiles issue 23: FP8 projections at 1-65 rows with the rows in one tile of 32 or 64 (row_tile) against
#             powers of two largest first, then the 27B FP8 rows                          -> fp8_tiles/, fp8_27b/
#   w8a8      issue 23: the W8A8 kernel's first device run: tools/w8a8_check.py (each call against its reference,
#             printed as it returns; the rows quantised inside the kernel against quantised first, bit for bit), the
#             stream_matmul GPU tests, FP8 projections at 1, 16, 65 rows (W8A16 against W8A8, q|k|v and gate|up apart
#             and packed, packed with the rows quantised in XLA first; W8A8 with promote_k 32 and 0)
#                                                                                  -> w8a8_probe/, w8a8_promote/
#   kv_write  issue 19: the AR step's K/V written into the cache by the q/k-norm-RoPE kernel (layers.FUSED_KV_WRITE,
#             on since an H100 A/B, 2026-12-05): its GPU tests and the engine's same-tokens test compiled, then the 8B
#             rounds with the writes after the layers and fused (tools/with_knobs.py engine:fused_kv_write=0|1)
#                                                                                              -> kv_{after,fused}/
#   w8a8_splits  issue 23: W8A8 packed projections at 1, 16, 65 rows with k in splits (now) against one split,
#             4-8 stages (one split: no XLA sum after the kernel), 64 weight rows a program and 32 or 16 (twice or
#             four times the programs; below 64 Triton leaves FP8 wgmma for mma.sync on f16 copies)
#                                                                                                -> w8a8_splits/
#   goals     both issues' goal figures in one call ($GOALS_S, 560 s; each part skipped or cut to what is left): the
#             W8A8 smoke (tools/w8a8_check.py), the 8B bf16 and FP8 W8A8 rounds (AR, DFlash, DDTree 15, 64), the build
#             at B = 64 / 512 (deep and i.i.d. logits, XLA against the kernels), W8A16 AR, the 8B DDTree rounds at
#             B = 256 / 512 (the K/V-write A/B it ran until 2026-12-05 night: settled, on)
#                                                               -> w8a8_check.txt, goals.tar (goals/NAME/bench.json, goals/build_peak{20,0}/)
#   dense_stream  the bf16 8B rounds (AR, DFlash, DDTree 15, 31) with the dense projections of small calls streamed
#             (layers.DENSE_STREAM_MAX_ROWS: 32, the default since 2026-12-05, and 16), between two runs without (0;
#             ten repeats each; ~160 s)                                              -> dense_stream.tar (N/bench.json)
#   knobs_bench  the bench ($AB_SHAPE, $AB_MODES, $AB_BUDGETS, $AB_ARGS) with each ';'-separated set of $KNOBS
#             (tools/with_knobs.py items) alternating with the defaults, $KNOBS_ROUNDS times    -> knobs_bench.tar
#   w8a8_rounds  the 8B FP8 rounds with --fp8-matmul stream (packed q|k|v and gate|up since 2026-12-05) and w8a8,
#             the 27B's with w8a8 (a call of its own)        -> stream_qwen3-8b/, w8a8_qwen3-8b/, w8a8_qwen3.6-27b/
#   knobs_fp8_8b  the 8B FP8 rounds (streamed) with fp8_bits 0 and 1                     -> fp8_bits{0,1}/
#   fp8       tools/gpu_probe.py's FP8 projections (bf16, dequantised, streamed) at 1, 16 and 65 rows, then the 8B
#             rounds with FP8 weights, streamed against dequantised (issue 23)        -> fp8_probe/, fp8_{dequantize,stream}/
#   auto_scopes  --budget auto per call and per round on the demo pair beside DFlash and B = 15, 31, 63 (issue 22),
#             from an empty record, then from the kept one                          -> auto_scopes_{fresh,kept}/
#   auto_cost what an auto round costs beyond the fixed round it runs (issue 22): the demo shape's fixed DFlash and
#             B = 16 rounds, then the demo pair with auto's calibration (its round_costs_s), one decode of each row traced
#             (kernels and gaps per round, prefill included)                 -> demo_shape/, demo_auto/, auto_trace_summary.json
#   invariant the row-invariant mode (issue 20): its GPU tests, greedy equality with --row-invariant on random 8B
#             weights (B = 16, 64, 256) and the demo pair                                        -> invariant/
#   invariant_bench  the 8B bench with and without the row-invariant mode                     -> invariant/
#   demo_e2e  the bench on the shipped demo pair (checkpoints, bf16, held-out prompts)    -> demo/
#   demo_bg, demo_pack   the demo pair's training in the background, and collecting it in a later call
#   invariant_demo  greedy equality with --row-invariant on the demo pair at B = $INV_DEMO_BUDGETS ($INV_DEMO_ARGS,
#             e.g. --batch 8: the prompts in groups)                                                -> invariant/
#   retrain_bg, retrain_wait  tools/retrain_demo.sh (issue 24: extract, train, measure both drafters) in the
#             background, and collecting it (in this call or the next, while the machine is warm)     -> retrain/
#   l2        tools/l2_probe.py: a stand-in latency-bound kernel reading the next projection's weight into L2, then
#             the projection, against both without the reads (o_proj, q|k|v, down_proj shapes)     -> l2/, l2_chase64/
#   stream27b issue 19: the 27B's DFlash round streamed / not, traced: kernels by name and the streamed projections
#             against the XLA kernels they replace (trace_summary --against)
#                                                 -> stream27b_{on,off}/, kernels27b_{on,off}.json, against27b.txt
#   gdn_trace  the 27B's AR step, DFlash and B = 63 rounds (bf16; $GDN_TRACE_ARGS, e.g. "--weights fp8 --fp8-matmul
#             w8a8") traced: kernels by name, and $GDN_TRACE_SEQ (300:120) of each trace in launch order (what a Gated
#             DeltaNet layer launches besides its projections and its delta rule)    -> gdn_trace/, kernels27b.json, seq27b.txt
#   barrier   tools/barrier_probe.py: a layer's four 8B projections in one persistent kernel met at grid barriers,
#             against a launch each ($BARRIER_CONFIGS: its configs)                              -> barrier/
# Variables: BENCH_LIMIT, BUDGETS, KERNELS, MODES, REPEATS, KERNEL_LIMIT, KERNEL_ARGS, HYBRID_BUDGETS, HYBRID_MODES
# (e.g. ar,dflash,mtp,ddtree: the 27B's MTP head beside DFlash and DDTree).
set -uo pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
log() { echo "== $* ($(date +%H:%M:%S))"; }
# The GPU tests of tests/kernels/test_$2.py (a space-separated list) within $1 s, -k "$3" where given.
kernel_gpu_tests() {
  local files=() name
  for name in $2; do files+=("tests/kernels/test_$name.py"); done
  timeout -k 5 "$1" python3 -m pytest -q -o addopts="" -p no:cacheprovider -m gpu "${files[@]}" ${3:+-k "$3"} 2>&1 \
    | tail -2
}
# tools/topk_probe.py at V = 151936, deep trees' logits (peak 20) then i.i.d. ones (peak 0), into $OUT/$1_peak{20,0}:
# budgets $2, top-k forms $3, tree-build forms $4, each run within $5 s; the tables' rows printed.
build_probe() {
  local peak
  for peak in 20 0; do
    log "B = $2, V = 151936, peak $peak: top-k $3; build $4"
    timeout -k 5 "$5" python3 tools/topk_probe.py --out "$OUT/$1_peak$peak" --vocab 151936 --budgets "$2" \
      --top-k "$3" --tree-build "$4" --peak "$peak" 2>&1 | grep -E '^\||rror'
    rm -f "$OUT/$1_peak$peak/topk_probe.md"
  done
}

for step in "$@"; do
  case "$step" in
    smoke)
      log smoke
      nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
      python3 -c "import jax, flax, orbax.checkpoint as o; print(jax.__version__, flax.__version__, o.__version__, jax.devices())"
      ;;
    probe)
      log probe
      timeout "${PROBE_LIMIT:-150}" python3 tools/gpu_probe.py --out "$OUT" 2>&1 | grep -v '^{'
      ;;
    bench)
      log "bench qwen3-8b"
      timeout "${BENCH_LIMIT:-420}" python3 -m ddtree_jax.bench --shape qwen3-8b --context 2048 \
        --budgets "${BUDGETS:-16,64,256,512}" --modes "${MODES:-ar,dflash,ddtree}" --repeats "${REPEATS:-10}" \
        --kernels "${KERNELS:-pallas,jax}" --trace /tmp/traces --out "$OUT/bench" 2>&1 | grep -v '^{"mode"'
      # The Perfetto JSON of each row's trace, one tar (the TensorBoard files stay behind).
      (cd /tmp/traces 2>/dev/null && find . -name perfetto_trace.json.gz | tar -cf "$OUT/traces.tar" -T -)
      timeout 60 python3 tools/trace_summary.py /tmp/traces --top "${TRACE_TOP:-12}" --json > "$OUT/trace_summary.json"
      ;;
    equality)
      log "greedy equality, bf16, default kernels"
      timeout "${EQUALITY_LIMIT:-200}" python3 tools/greedy_equality.py --shape qwen3-8b --budgets 16,64 \
        --max-new-tokens 32 --out "$OUT/equality/qwen3-8b.json"
      timeout 120 python3 tools/greedy_equality.py --budgets 16,64,256 --num-prompts 32 --max-new-tokens 96 \
        --out "$OUT/equality/demo.json"
      ;;
    kernels)
      log kernels
      # shellcheck disable=SC2086
      timeout "${KERNEL_LIMIT:-300}" python3 tools/kernel_check.py --out "$OUT/kernels" ${KERNEL_ARGS:-} \
        > /tmp/kernels.log 2>&1; echo "rc=$?"
      tail -60 /tmp/kernels.log
      ;;
    tests)
      log "GPU tests"
      timeout "${TESTS_LIMIT:-420}" python3 -m pytest -q -o addopts=-ra -p no:cacheprovider -m gpu tests --ignore=tests/test_notebooks.py 2>&1 | tail -15
      timeout 150 python3 -m pytest -q -x -o addopts=-ra -p no:cacheprovider tests/test_ddtree_decoding.py \
        -k "greedy or transfers" 2>&1 | tail -5
      ;;
    bitwise)
      log "row invariance of the forward's parts"
      timeout "${BITWISE_LIMIT:-240}" python3 tools/bitwise_probe.py --out "$OUT/bitwise" --t "${BITWISE_T:-16,65}" \
        --parts "${BITWISE_PARTS:-}" 2>&1
      ;;
    invariant)
      log "row-invariant mode: GPU tests, greedy equality, cost"
      mkdir -p "$OUT/invariant"
      timeout "${INV_TEST_LIMIT:-200}" python3 -m pytest -q --tb=short -o addopts=-ra -p no:cacheprovider -m gpu \
        tests/kernels/test_tree_attention.py tests/kernels/test_stream_matmul.py tests/models/test_qwen3.py \
        -k "row_invariant or row_tile or bitwise or matches" 2>&1 | tail -8
      timeout "${INV_EQ_LIMIT:-300}" python3 tools/greedy_equality.py --shape qwen3-8b --budgets 16,64,256 \
        --max-new-tokens 64 --num-prompts 8 --row-invariant --out "$OUT/invariant/equality_qwen3-8b.json"; echo "rc=$?"
      timeout "${INV_DEMO_LIMIT:-200}" python3 tools/greedy_equality.py --budgets 16,64,256 --num-prompts 32 \
        --max-new-tokens 128 --row-invariant --out "$OUT/invariant/equality_demo.json"; echo "rc=$?"
      ;;
    invariant_bench)
      log "the 8B rounds with and without the row-invariant mode"
      for flag in "" --row-invariant; do
        timeout "${INV_BENCH_LIMIT:-200}" python3 -m ddtree_jax.bench --shape qwen3-8b --budgets 16,64,256 --kernels pallas \
          $flag --out "$OUT/invariant/bench${flag:+_row_invariant}" 2>&1 | grep -E "^\||error" | tail -12
      done
      ;;
    kernel_tests)
      log "GPU tests of the changed kernels, and the hybrid engine with the Pallas kernels"
      changed="tests/kernels/test_tree_delta_rule.py tests/kernels/test_tree_attention.py tests/kernels/test_stream_matmul.py"
      # shellcheck disable=SC2086
      timeout "${KERNEL_TESTS_LIMIT:-200}" python3 -m pytest -q --tb=short -o addopts=-ra -p no:cacheprovider -m gpu \
        ${KERNEL_TESTS:-$changed} 2>&1 | tail -25
      timeout 150 python3 -m pytest -q --tb=short -o addopts=-ra -p no:cacheprovider tests/test_kernels_in_engine.py \
        -k "hybrid_with_pallas or ddtree_with_pallas" 2>&1 | tail -5
      ;;
    wide_defaults)
      log "top-k and tree-build kernels' GPU tests (the defaults above K = 128 of 2026-12-06)"
      kernel_gpu_tests 150 "vocab_top_k tree_build"
      build_probe wide 128,256,512 pallas reference,pallas 120
      for side in xla kernels; do
        log "8B DDTree rounds at B = 256, 512, tree kernels: $side"
        run="python3"; [ "$side" = xla ] && run="python3 tools/with_knobs.py engine:tree_kernels_up_to=128"
        timeout -k 5 "${WIDE_BENCH_LIMIT:-150}" $run -m ddtree_jax.bench --shape qwen3-8b --budgets 256,512 \
          --modes ddtree --repeats 3 --kernels pallas --out "$OUT/wide_$side" 2>&1 | grep -v '^{"mode"' | grep '^|'
        rm -f "$OUT/wide_$side"/bench.{md,png,partial.json}
      done
      ;;
    build_ncu)
      log "Nsight Compute: the tree-build kernel, deep trees"
      command -v ncu >/dev/null || { log "no ncu on this machine"; continue; }
      for b in ${NCU_BUDGETS:-512 64}; do
        # One launch after two (the probe's compile-time runs), no preallocation (ncu saves and restores device
        # memory around each replay pass), no CUDA graphs (under them the probe's process segfaulted, 2026-12-06)
        XLA_FLAGS="--xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 \
          "${NCU_LIMIT:-150}" ncu --kernel-name regex:tree_build \
          --launch-skip 2 --launch-count 1 --set full -f -o "$OUT/ncu_build_b$b" \
          python3 tools/topk_probe.py --out /tmp/ncu_probe --vocab 151936 --budgets "$b" --top-k pallas \
          --tree-build pallas --peak 20 --rounds 2 --passes 2 > /tmp/ncu_build.log 2>&1; echo "rc=$?"
        grep -E '^\||rror|==ERROR|Segmentation' /tmp/ncu_build.log | tail -4
        [ -f "$OUT/ncu_build_b$b.ncu-rep" ] || continue
        ncu -i "$OUT/ncu_build_b$b.ncu-rep" --page details --print-details all > "$OUT/ncu_build_b$b.txt" 2>&1
        grep -E "Duration|Registers Per|Warp Cycles Per Issued|Issued Warp|Stall" "$OUT/ncu_build_b$b.txt" | head -12
        ncu -i "$OUT/ncu_build_b$b.ncu-rep" --page source --csv --print-source sass \
          > "$OUT/ncu_build_b${b}_source.csv" 2>&1
        head -c 600 "$OUT/ncu_build_b${b}_source.csv"; echo
      done
      ;;
    knobs_rounds)
      IFS=';' read -ra sets <<< ";${KNOBS:?}"  # the defaults first
      for i in "${!sets[@]}"; do
        run="python3"; [ -n "${sets[$i]}" ] && run="python3 tools/with_knobs.py ${sets[$i]} -m"
        log "demo rounds, knobs '${sets[$i]}'"
        timeout "${LC_LIMIT:-150}" $run tools/loop_cost.py --modes dflash,15,31,63 --auto '' --rounds 48 --repeats 5 \
          --out "$OUT/lc_$i.json" 2>&1 | tail -6
      done
      for i in "${!sets[@]}"; do
        run="python3"; [ -n "${sets[$i]}" ] && run="python3 tools/with_knobs.py ${sets[$i]}"
        log "demo pair end to end, knobs '${sets[$i]}'"
        timeout "${DEMO_LIMIT:-150}" $run -m ddtree_jax.bench --modes ar,dflash,ddtree --budgets 15,31,63 \
          --num-prompts 32 --max-new-tokens 128 --out "$OUT/demo_$i" 2>&1 | grep '^|'
        rm -f "$OUT/demo_$i"/bench.{md,png,partial.json}
      done
      ;;
    fp8_tiles)
      log "FP8 projections, row tiles"
      timeout "${FP8_PROBE_LIMIT:-150}" python3 tools/gpu_probe.py --out "$OUT/fp8_tiles" --forms stream_fp8 \
        --tokens 1,16,17,32,33,64,65 --layers 12 --no-ceilings \
        --stream-configs 64x128x4x4x1,64x128x4x4x1x32,64x128x4x4x1x64 2>&1 | grep '^|' | grep -v lm_head
      log "27B FP8 rows"
      timeout "${FP8_27B_LIMIT:-400}" python3 -m ddtree_jax.bench --shape qwen3.6-27b --weights fp8 --budgets 15,63 \
        --modes ar,dflash,ddtree --repeats 3 --kernels pallas --out "$OUT/fp8_27b" 2>&1 | grep -v '^{"mode"' | grep '^|'
      rm -f "$OUT/fp8_27b"/bench.{md,png}
      ;;
    w8a8)
      log "W8A8 kernel calls against the reference"
      timeout -k 5 "${W8A8_CHECK_LIMIT:-90}" python3 tools/w8a8_check.py
      log "stream_matmul GPU tests"
      timeout -k 5 "${W8A8_TEST_LIMIT:-120}" python3 -m pytest -o addopts="" -q -m gpu tests/kernels/test_stream_matmul.py \
        2>&1 | tail -5
      log "FP8 projections: W8A16 against W8A8, apart and packed (fused)"
      timeout -k 5 "${FP8_PROBE_LIMIT:-150}" python3 tools/gpu_probe.py --out "$OUT/w8a8_probe" --tokens 1,16,65 \
        --forms stream_fp8,stream_fp8_fused,stream_w8a8,stream_w8a8_fused,stream_w8a8_apart_fused --layers 12 --no-ceilings \
        --stream-configs 64x128x4x4x1 2>&1 | grep '^|' | grep -v lm_head
      log "W8A8 projections: promote_k 32 and 0 (Pallas's dot)"
      timeout -k 5 "${FP8_PROBE_LIMIT:-100}" python3 tools/gpu_probe.py --out "$OUT/w8a8_promote" --tokens 1,65 \
        --forms stream_w8a8 --layers 12 --no-ceilings --stream-configs 64x128x4x4x1x0x32,64x128x4x4x1x0x0 \
        2>&1 | grep '^|' | grep -v lm_head
      ;;
    kv_write)
      log "q/k-norm-RoPE GPU tests, the K/V written into the cache by it: same tokens, compiled"
      timeout -k 5 150 python3 -m pytest -q -o addopts="" -m gpu tests/kernels/test_qk_norm_rope.py 2>&1 | tail -3
      timeout -k 5 150 python3 -m pytest -q -o addopts="" tests/test_kernels_in_engine.py -k fused_kv 2>&1 | tail -3
      for side in after fused; do
        log "8B rounds, K/V written $side"
        run="python3 tools/with_knobs.py engine:fused_kv_write=$([ "$side" = fused ] && echo 1 || echo 0)"
        timeout -k 5 "${KV_BENCH_LIMIT:-130}" $run -m ddtree_jax.bench --shape qwen3-8b --budgets 15 \
          --modes ar,dflash,ddtree --repeats 5 --kernels pallas --out "$OUT/kv_$side" 2>&1 | grep -v '^{"mode"' | grep '^|'
        rm -f "$OUT/kv_$side"/bench.{md,png,partial.json}
      done
      ;;
    w8a8_splits)
      log "W8A8 packed projections: k in splits as now, against one split (no split sums after the kernel)"
      timeout -k 5 "${FP8_PROBE_LIMIT:-200}" python3 tools/gpu_probe.py --out "$OUT/w8a8_splits" --tokens 1,16,65 \
        --forms stream_w8a8_fused --layers 12 --no-ceilings \
        --stream-configs 64x128x4x4,64x128x4x4x0x0x128x1,64x128x4x8x0x0x128x1,32x128x4x4x0x0x128x1,32x128x4x8x0x0x128x1,16x128x4x4x0x0x128x1 \
        2>&1 | grep '^|' | grep -v lm_head
      ;;
    goals)
      goals_end=$(( $(date +%s) + ${GOALS_S:-560} ))  # every part clamped to what is left of the call, or skipped
      log "W8A8 smoke"
      timeout -k 5 60 python3 tools/w8a8_check.py --promote block 2>&1 | grep -v Warn | tail -12 > "$OUT/w8a8_check.txt"
      tail -3 "$OUT/w8a8_check.txt"
      goal_bench() {  # name, limit, python3 arguments...
        local name=$1 lim=$2 left=$(( goals_end - $(date +%s) )); shift 2
        [ "$left" -lt 40 ] && { log "skip $name"; return; }
        [ "$lim" -gt $(( left - 5 )) ] && lim=$(( left - 5 ))
        log "$name"
        timeout -k 5 "$lim" python3 "$@" --out "$OUT/goals/$name" 2>&1 | grep -v '^{"mode"' \
          | grep -E '^\| (ar|dflash|ddtree)|rror'
        rm -f "$OUT/goals/$name"/bench.{md,png,partial.json}
      }
      # bf16 first: issue 19's rounds are the figures a call cut short should still bring back
      goal_bench bf16 150 -m ddtree_jax.bench --shape qwen3-8b --budgets 15,64 --modes ar,dflash,ddtree --repeats 5 \
        --kernels pallas
      goal_bench w8a8 150 -m ddtree_jax.bench --shape qwen3-8b --weights fp8 --fp8-matmul w8a8 --budgets 15,64 \
        --modes ar,dflash,ddtree --repeats 5 --kernels pallas
      for peak in 20 0; do
        [ $(( goals_end - $(date +%s) )) -lt 100 ] && { log "skip build, peak $peak"; continue; }
        log "build B = 64, 512, peak $peak"
        timeout -k 5 100 python3 tools/topk_probe.py --out "$OUT/goals/build_peak$peak" --vocab 151936 \
          --budgets 64,512 --top-k threshold,pallas --tree-build reference,pallas --peak "$peak" 2>&1 | grep -E '^\||rror'
        rm -f "$OUT/goals/build_peak$peak/topk_probe.md"  # (inside goals.tar: a call returns 8 files at most)
      done
      goal_bench stream 70 -m ddtree_jax.bench --shape qwen3-8b --weights fp8 --fp8-matmul stream --modes ar \
        --repeats 5 --kernels pallas
      goal_bench wide 150 -m ddtree_jax.bench --shape qwen3-8b --budgets 256,512 --modes ddtree --repeats 3 \
        --kernels pallas
      (cd "$OUT" && tar cf goals.tar goals && rm -rf goals)
      ;;
    knobs_bench)
      # Each ';'-separated set of $KNOBS (tools/with_knobs.py items, space-separated) against the defaults, alternating
      # $KNOBS_ROUNDS times (default 2: defaults, set 1, set 2 ..., defaults, set 1 ...), the bench at $AB_SHAPE
      # ($AB_MODES, $AB_BUDGETS, $AB_REPEATS, $AB_ARGS e.g. "--weights fp8 --fp8-matmul w8a8"); each run within
      # $KNOBS_LIMIT s (a cold 27B compile needs ~240 for its first)
      IFS=';' read -ra sets <<< ";${KNOBS:?}"
      for round in $(seq "${KNOBS_ROUNDS:-2}"); do
        for i in "${!sets[@]}"; do
          run="python3 -m"; [ -n "${sets[$i]}" ] && run="python3 tools/with_knobs.py ${sets[$i]} -m"
          log "${AB_SHAPE:-qwen3-8b} rounds, knobs '${sets[$i]:-defaults}' (round $round)"
          # shellcheck disable=SC2086
          timeout -k 5 "${KNOBS_LIMIT:-90}" $run ddtree_jax.bench --shape "${AB_SHAPE:-qwen3-8b}" \
            --budgets "${AB_BUDGETS:-15,64}" --modes "${AB_MODES:-ar,dflash,ddtree}" --repeats "${AB_REPEATS:-5}" \
            --kernels pallas ${AB_ARGS:-} --out "$OUT/knobs_bench/${round}_$i" 2>&1 | grep -E '^\| (ar|dflash|ddtree)|rror'
          mkdir -p "$OUT/knobs_bench/${round}_$i" && echo "${sets[$i]}" > "$OUT/knobs_bench/${round}_$i/knobs.txt"
          rm -f "$OUT/knobs_bench/${round}_$i"/bench.{md,png,partial.json}
        done
      done
      (cd "$OUT" && tar cf knobs_bench.tar knobs_bench && rm -rf knobs_bench)
      ;;
    dense_stream)
      i=0
      for knobs in "dense_stream_max_rows=0" "" "dense_stream_max_rows=16" "dense_stream_max_rows=0"; do
        i=$((i + 1))
        log "8B bf16 rounds, engine knobs '${knobs:-defaults}'"
        run="python3 -m"; [ -n "$knobs" ] && run="python3 tools/with_knobs.py engine:$knobs -m"
        timeout -k 5 "${DENSE_STREAM_LIMIT:-70}" $run ddtree_jax.bench --shape qwen3-8b --budgets 15,31 \
          --modes ar,dflash,ddtree --repeats 10 --kernels pallas --out "$OUT/dense_stream/$i" 2>&1 \
          | grep -E '^\| (ar|dflash|ddtree)|rror'
        rm -f "$OUT/dense_stream/$i"/bench.{md,png,partial.json}
      done
      (cd "$OUT" && tar cf dense_stream.tar dense_stream && rm -rf dense_stream)
      ;;
    w8a8_rounds)
      for run in qwen3-8b:stream qwen3-8b:w8a8 qwen3.6-27b:w8a8; do
        shape=${run%%:*} matmul=${run##*:}
        log "$shape FP8 rounds, --fp8-matmul $matmul"
        timeout -k 5 "${W8A8_BENCH_LIMIT:-180}" python3 -m ddtree_jax.bench --shape "$shape" --weights fp8 --budgets 15,64 \
          --modes ar,dflash,ddtree --repeats 3 --kernels pallas --fp8-matmul "$matmul" --out "$OUT/${matmul}_$shape" \
          2>&1 | grep -v '^{"mode"' | grep '^|'
        rm -f "$OUT/${matmul}_$shape"/bench.{md,png,partial.json}
      done
      ;;
    knobs_fp8_8b)
      # Issue 23: the 8B rounds with FP8 weights streamed, stream_matmul's fp8_bits 0 (as now) then 1
      base="import dataclasses, runpy, sys; sys.argv = ['bench'] + sys.argv[1:]; from ddtree_jax.models import layers as l"
      for bits in 0 1; do
        log "knobs: 8B FP8 rounds, fp8_bits=$bits"
        timeout "${FP8_LIMIT:-240}" python3 -c "$base; l.FP8_STREAM_KNOBS = dataclasses.replace(l.FP8_STREAM_KNOBS, \
fp8_bits=$bits); runpy.run_module('ddtree_jax.bench', run_name='__main__')" --shape qwen3-8b --weights fp8 \
          --budgets 16,64 --modes ar,dflash,ddtree --repeats 5 --kernels pallas --fp8-matmul stream \
          --out "$OUT/fp8_bits$bits" 2>&1 | grep -v '^{"mode"' | grep '^|'
        rm -f "$OUT/fp8_bits$bits"/bench.{md,png,partial.json}
      done
      ;;
    fp8)
      log "FP8 projections and rounds"
      timeout "${FP8_PROBE_LIMIT:-150}" python3 tools/gpu_probe.py --out "$OUT/fp8_probe" --forms hf,fp8,stream_fp8 \
        --tokens 1,16,65 --no-ceilings 2>&1 | grep '^|' | grep -v lm_head
      for how in dequantize stream; do
        timeout "${FP8_LIMIT:-180}" python3 -m ddtree_jax.bench --shape qwen3-8b --weights fp8 --budgets 16,64 \
          --modes ar,dflash,ddtree --repeats 5 --kernels pallas --fp8-matmul "$how" --out "$OUT/fp8_$how" 2>&1 \
          | grep -v '^{"mode"' | grep '^|'
        rm -f "$OUT/fp8_$how"/bench.{md,png,partial.json}
      done
      ;;
    auto_cost)
      log "auto's round against the fixed rounds (demo)"
      timeout "${AUTO_LIMIT:-150}" python3 -m ddtree_jax.bench --shape demo --budgets 16 --modes dflash,ddtree \
        --repeats 10 --kernels pallas --out "$OUT/demo_shape" 2>&1 | grep -v '^{"mode"' | grep '^|'
      timeout "${AUTO_LIMIT:-150}" python3 -m ddtree_jax.bench --budgets 16,auto --auto-scope round --modes dflash,ddtree \
        --max-new-tokens 128 --num-prompts 12 --recalibrate --trace /tmp/auto_traces --out "$OUT/demo_auto" 2>&1 | tail -6
      rm -f "$OUT"/demo_shape/bench.{md,png,partial.json} "$OUT"/demo_auto/bench.{md,partial.json}
      timeout 60 python3 tools/trace_summary.py /tmp/auto_traces --top 12 2>&1 | tail -60
      timeout 60 python3 tools/trace_summary.py /tmp/auto_traces --top 30 --json > "$OUT/auto_trace_summary.json"
      ;;
    auto_scopes)
      # Issue 22 on the demo pair: --budget auto per call and per round beside the fixed candidates, from an empty
      # record and calibration, then again from what the first run kept (the per-call record, the round costs)
      log "auto per call and per round (demo), fresh then kept"
      for run in fresh kept; do
        timeout "${AUTO_LIMIT:-270}" python3 -m ddtree_jax.bench --budgets 15,31,63,auto --auto-scope call,round \
          --num-prompts 32 --max-new-tokens 128 $([ "$run" = fresh ] && echo --recalibrate) \
          --out "$OUT/auto_scopes_$run" 2>&1 | grep -v '^{"mode"' | grep -E '^\||^ddtree auto'
        rm -f "$OUT/auto_scopes_$run"/bench.{md,partial.json}
      done
      ;;
    loop_cost)
      # What a decode-loop call costs beyond its rounds, right after a prefill and again on its own state (issue
      # 22), with XLA's default flags, then with each of $LOOP_COST_XLA (XLA_FLAGS variants separated by ';')
      log "decode-loop call costs ${LOOP_ARGS:-}"
      mkdir -p "$OUT/loop_cost"
      # shellcheck disable=SC2086
      timeout "${LOOP_LIMIT:-200}" python3 tools/loop_cost.py ${LOOP_ARGS:-} --out "$OUT/loop_cost/default.json"
      IFS=';' read -ra variants <<< "${LOOP_COST_XLA:-}"
      i=0
      for flags in "${variants[@]}"; do
        i=$((i + 1)); echo "-- XLA_FLAGS=$flags"
        # shellcheck disable=SC2086
        XLA_FLAGS="$flags" timeout "${LOOP_LIMIT:-200}" python3 tools/loop_cost.py ${LOOP_ARGS:-} \
          --out "$OUT/loop_cost/variant$i.json"
      done
      ;;
    gdn)
      log "Gated DeltaNet tree rule and solves"
      # shellcheck disable=SC2086
      timeout "${GDN_LIMIT:-200}" python3 tools/gdn_probe.py --out "$OUT/gdn" ${GDN_ARGS:-} 2>&1
      ;;
    hybrid)
      log "bench qwen3.6-27b"
      timeout "${HYBRID_LIMIT:-420}" python3 -m ddtree_jax.bench --shape qwen3.6-27b --context 2048 \
        --budgets "${HYBRID_BUDGETS:-16,64,256}" --modes "${HYBRID_MODES:-ar,dflash,ddtree}" --repeats 5 --kernels pallas \
        --out "$OUT/hybrid" 2>&1 | grep -v '^{"mode"'
      ;;
    bench_ab)
      log "bench A/B: ${BASELINE:?} then this tree"
      for side in ${AB_SIDES:-baseline current}; do  # AB_SIDES=current: this tree alone (a rerun)
        dir="$PWD"; [ "$side" = baseline ] && dir="$BASELINE"
        trace=""; [ "$side" = current ] && trace="--trace /tmp/ab_traces"
        # AB_TREE_RULE=KNOBS: this tree's side with the Gated DeltaNet tree rule's knobs changed (tools/with_tree_rule.py)
        run="python3"; [ "$side" = current ] && [ -n "${AB_TREE_RULE:-}" ] && run="python3 $PWD/tools/with_tree_rule.py $AB_TREE_RULE"
        # shellcheck disable=SC2086
        (cd "$dir" && PYTHONPATH="$dir" timeout "${AB_LIMIT:-200}" $run -m ddtree_jax.bench --shape "${AB_SHAPE:-qwen3-8b}" \
          --context 2048 --budgets "${AB_BUDGETS:-16,64}" --modes "${AB_MODES:-ar,dflash,ddtree}" \
          --repeats "${AB_REPEATS:-10}" --kernels pallas \
          $trace --out "$OUT/ab/$side" 2>&1 | grep -v '^{"mode"' | tail -12)
        rm -f "$OUT/ab/$side"/bench.{md,png,partial.json}  # the table is in the log; few files come back
      done
      timeout 60 python3 tools/trace_summary.py /tmp/ab_traces --top 8 2>&1 | tail -60
      timeout 60 python3 tools/trace_summary.py /tmp/ab_traces --top "${TRACE_TOP:-12}" --json > "$OUT/ab/trace_summary.json"
      ;;
    tree)
      log "tree build against ${BASELINE:?}"
      timeout "${TREE_LIMIT:-150}" python3 tools/topk_probe.py --out "$OUT/tree" --vocab 151936 \
        --budgets 16,64,256,512 --baseline "$BASELINE/ddtree_jax/tree.py" 2>&1 | grep -v '^{'
      ;;
    build)
      log "tree-build and vocabulary top-k kernels: GPU tests, then the probe"
      timeout 150 python3 -m pytest -q --tb=short -o addopts=-ra -p no:cacheprovider -m gpu \
        tests/kernels/test_tree_build.py tests/kernels/test_vocab_top_k.py 2>&1 | tail -25
      timeout "${BUILD_LIMIT:-200}" python3 tools/topk_probe.py --out "$OUT/build" --vocab "${BUILD_VOCAB:-151936,8192}" \
        --budgets "${BUILD_BUDGETS:-16,64,128}" --top-k "${BUILD_TOP_K:-threshold,pallas}" \
        --tree-build "reference,${BUILD_KERNELS:-pallas}" --depths 15 2>&1 | grep -v '^{'
      rm -f "$OUT/build/topk_probe.md"
      ;;
    hlo)
      log "HLO dump and traces"
      XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" timeout "${HLO_LIMIT:-150}" python3 -m ddtree_jax.bench \
        --shape "${HLO_SHAPE:-qwen3-8b}" --context 2048 --budgets "${HLO_BUDGETS:-64}" --modes "${HLO_MODES:-ar,dflash,ddtree}" \
        --repeats 3 --kernels pallas --trace /tmp/hlo_traces --out /tmp/hlo_bench 2>&1 | grep '^|'
      (cd /tmp/hlo && ls -S | grep 'after_optimizations.txt$' | head -"${HLO_FILES:-12}" | tar -cJf "$OUT/hlo.tar.xz" -T -)
      (cd /tmp/hlo_traces && find . -name perfetto_trace.json.gz | tar -cf "$OUT/hlo_traces.tar" -T -)
      ls -la "$OUT"
      ;;
    xla)
      # The bench under each XLA_FLAGS variant of $XLA_VARIANTS (';'-separated; 'default' = no flags), traced and
      # summarised. A flag this jaxlib does not know aborts its run at once (XLA rejects unknown flags).
      log "bench under XLA flag variants"
      IFS=';' read -ra variants <<< "${XLA_VARIANTS:-default;--xla_gpu_experimental_force_split_k=1}"
      i=0
      for flags in "${variants[@]}"; do
        i=$((i + 1)); [ "$flags" = default ] && flags=""
        echo "-- variant $i: XLA_FLAGS='$flags'"
        XLA_FLAGS="$flags" timeout "${XLA_LIMIT:-150}" python3 -m ddtree_jax.bench --shape "${XLA_SHAPE:-qwen3-8b}" \
          --context 2048 --budgets "${XLA_BUDGETS:-64}" --modes "${XLA_MODES:-ar,dflash,ddtree}" --repeats "${XLA_REPEATS:-10}" \
          --kernels pallas --trace "/tmp/xla_$i" \
          --out "$OUT/xla/v$i" 2>&1 | grep '^|\|rror'
        rm -f "$OUT/xla/v$i"/bench.{md,png,partial.json}
        timeout 60 python3 tools/trace_summary.py "/tmp/xla_$i" --top 8 2>&1 | grep -v '^    '
      done
      ;;
    ncu)
      # Nsight Compute on the tree attention at S = 2048, T = $NCU_T (if this machine has ncu).
      log "Nsight Compute: tree attention"
      ls -d /usr/local/cuda*/bin 2>/dev/null; command -v ncu nsys
      if command -v ncu >/dev/null; then
        for t in ${NCU_T:-65 16}; do
          # No preallocation: ncu saves and restores all device memory around every replay pass (2026-12-02:
          # with JAX's default 75% preallocated, two kernels took over 100 s).
          XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_LIMIT:-120}" ncu --kernel-name regex:tree_attention --launch-skip 2 --launch-count 2 \
            --set full --print-details all python3 tools/attention_once.py --t "$t" \
            > "$OUT/ncu_t$t.txt" 2>&1; echo "rc=$?"; grep -v '^==PROF==' "$OUT/ncu_t$t.txt" | tail -150
        done
      fi
      ;;
    demo_trace)
      log "demo shape, traced"
      timeout "${DEMO_TRACE_LIMIT:-200}" python3 -m ddtree_jax.bench --shape demo --budgets "${DEMO_SHAPE_BUDGETS:-16,64}" \
        --modes ar,dflash,ddtree --repeats 10 --kernels pallas --trace /tmp/demo_traces --out "$OUT/demo_shape" 2>&1 \
        | grep -v '^{"mode"' | grep '^|'
      rm -f "$OUT/demo_shape"/bench.{md,png,partial.json}
      timeout 60 python3 tools/trace_summary.py /tmp/demo_traces --top "${TRACE_TOP:-30}" --json \
        > "$OUT/demo_trace_summary.json"
      ;;
    matmul)
      log "matmul forms and XLA variants"
      mkdir -p "$OUT/matmul"
      first=1
      for variant in ${MATMUL_VARIANTS:-default}; do
        case "$variant" in
          default) flags="" ;;
          cublas) flags="--xla_gpu_enable_triton_gemm=false" ;;
          cublaslt) flags="--xla_gpu_enable_cublaslt=true" ;;
          exhaustive) flags="--xla_gpu_exhaustive_tiling_search=true" ;;
          triton) flags="--xla_gpu_cublas_fallback=false" ;;
          *) flags="$variant" ;;
        esac
        extra="--no-ceilings"; [ $first = 1 ] && extra=""; first=0
        # shellcheck disable=SC2086
        forms="${MATMUL_FORMS:-hf,fused,stream}"; [ "$variant" != default ] && forms="${MATMUL_VARIANT_FORMS:-hf}"
        XLA_FLAGS="$flags" timeout "${MATMUL_LIMIT:-120}" python3 tools/gpu_probe.py --out "$OUT/matmul/$variant" \
          --label "$variant" --forms "$forms" $extra ${MATMUL_ARGS:-} 2>&1 | grep '^|' | grep -v lm_head
      done
      ;;
    sweeps)
      # Each of $SWEEPS (default both; one a call: on an H100 on 2026-12-06 each took more than 275 s, its rows
      # compiled in parallel before any was timed) with its rows compiled one at a time, just before each is timed,
      # so a cut run keeps the rows it timed (printed, and in bench.partial.json).
      for sweep in ${SWEEPS:-batch context}; do
        case "$sweep" in
          batch) args="--batch ${SWEEP_BATCH:-1,4,16} --context 2048" ;;
          context) args="--context ${SWEEP_CONTEXT:-8192,32768} --batch 1" ;;
          *) log "unknown sweep '$sweep' (batch, context)"; continue ;;
        esac
        log "$sweep sweep: $args"
        # shellcheck disable=SC2086
        timeout -k 5 "${SWEEP_LIMIT:-500}" python3 -m ddtree_jax.bench --shape qwen3-8b \
          --budgets "${SWEEP_BUDGETS:-15,64}" --modes ar,dflash,ddtree --repeats "${SWEEP_REPEATS:-3}" --kernels pallas \
          --compile-workers 1 $args \
          --out "$OUT/sweep_$sweep" 2>&1 | grep -E '^\{"mode"|^\||rror'
        rm -f "$OUT/sweep_$sweep/bench.md"
      done
      ;;
    float32)
      log "float32: GPU tests and cost"
      timeout 120 python3 -m pytest -q -o addopts=-ra -p no:cacheprovider -m gpu tests/models/test_qwen3_float64.py \
        tests/test_matmul_precision.py 2>&1 | tail -3
      for precision in highest default; do
        timeout "${F32_LIMIT:-150}" python3 -m ddtree_jax.bench --shape qwen3-8b --dtype float32 --matmul-precision \
          "$precision" --budgets 64 --modes ar,ddtree --repeats 5 --kernels jax --out "$OUT/f32_$precision" 2>&1 \
          | grep -v '^{"mode"' | grep '^| \(ar\|ddtree\)'
      done
      ;;
    demo_e2e)
      log "demo pair end to end"
      timeout "${DEMO_LIMIT:-240}" python3 -m ddtree_jax.bench --budgets "${DEMO_BUDGETS:-16,64}" --max-new-tokens 128 \
        --num-prompts "${DEMO_PROMPTS:-12}" ${DEMO_ARGS:-} --out "$OUT/demo" 2>&1 | tail -8
      rm -f "$OUT/demo"/bench.{md,partial.json}
      ;;
    demo_bg)
      # The demo training (python -m ddtree_jax.train.demo) in its own process session on GPU $DEMO_GPU, so it
      # outlives this call while the machine stays warm (two-GPU kinds: GPU 1 trains while GPU 0 measures).
      log "demo training in the background on GPU ${DEMO_GPU:-1}"
      CUDA_VISIBLE_DEVICES="${DEMO_GPU:-1}" setsid nohup python3 -m ddtree_jax.train.demo --out /tmp/demo \
        > /tmp/demo.log 2>&1 < /dev/null &
      ;;
    demo_pack)
      # In a later call on the same machine: wait for it (at most $DEMO_WAIT s), split the result into <= 15 MB parts.
      log "waiting for the demo training"
      for _ in $(seq "${DEMO_WAIT:-300}"); do [ -f /tmp/demo/summary.json ] && break; sleep 1; done
      cp /tmp/demo.log "$OUT/demo.log"; tail -5 /tmp/demo.log
      if [ -f /tmp/demo/summary.json ]; then
        tar -C /tmp -cf - --exclude=checkpoints demo | split -b 15M - "$OUT/demo.tar.part-"; ls -la "$OUT"
      fi
      ;;
    invariant_demo)
      log "row-invariant greedy equality on the demo pair, B = ${INV_DEMO_BUDGETS:-256} (held-out prompts x 128: 32, or as ${INV_DEMO_ARGS:-} says)"
      mkdir -p "$OUT/invariant"
      timeout "${INV_DEMO_LIMIT:-420}" python3 tools/greedy_equality.py --budgets "${INV_DEMO_BUDGETS:-256}" \
        --num-prompts 32 --max-new-tokens 128 --row-invariant ${INV_DEMO_ARGS:-} --out "$OUT/invariant/equality_demo.json"
      echo "rc=$?"
      ;;
    retrain_bg)
      # tools/retrain_demo.sh (issue 24) in its own process session: it outlives this call while the machine
      # stays warm (the next call within the warm window collects it with retrain_wait). Shares the GPU with the
      # steps after it: both take under half its memory.
      log "demo drafter retraining in the background"
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
      RETRAIN_DIR=/tmp/retrain setsid nohup bash tools/retrain_demo.sh > /tmp/retrain.log 2>&1 < /dev/null &
      ;;
    retrain_wait)
      # Wait for it until $RETRAIN_WAIT s after this call's start, then bring back what it made.
      log "waiting for the retraining"
      while [ ! -f /tmp/retrain/done ] && [ "$SECONDS" -lt "${RETRAIN_WAIT:-560}" ]; do sleep 5; done
      cat /tmp/retrain/stages.log; tail -25 /tmp/retrain.log
      mkdir -p "$OUT/retrain"; cp /tmp/retrain.log "$OUT/retrain/"
      for f in drafter.tar train_log.json loss.png acceptance.png bench_shipped.json bench_new.json; do
        [ -f "/tmp/retrain/$f" ] && cp "/tmp/retrain/$f" "$OUT/retrain/"
      done
      ls -la "$OUT/retrain"
      ;;
    l2)
      # Does a weight read into L2 under a latency-bound kernel make its projection faster (tools/l2_probe.py)
      log "L2 probe"
      timeout -k 5 "${L2_LIMIT:-200}" python3 tools/l2_probe.py --out "$OUT/l2" \
        --shapes "${L2_SHAPES:-4096x4096,6144x4096,4096x12288}" --fractions 0.5,1 2>&1 | grep -E '^\||rror'
      timeout -k 5 100 python3 tools/l2_probe.py --out "$OUT/l2_chase64" --shapes 4096x4096 --fractions 0.25,0.5,1 \
        --chase 64 2>&1 | grep -E '^\||rror'
      ;;
    stream27b)
      # The 27B's DFlash round with small calls' projections streamed (the default) and not, traced; each compiled
      # kernel's time a round, and the streamed projections against the XLA kernels they replace (--against)
      for side in on off; do
        knobs=""; [ "$side" = off ] && knobs="engine:dense_stream_max_rows=0"
        log "27B DFlash, streaming $side"
        # shellcheck disable=SC2086
        timeout -k 5 "${STREAM27B_LIMIT:-260}" python3 ${knobs:+tools/with_knobs.py $knobs} -m ddtree_jax.bench \
          --shape qwen3.6-27b --modes dflash --repeats 3 --kernels pallas --trace "/tmp/traces27b/$side" \
          --out "$OUT/stream27b_$side" 2>&1 | grep -E '^\| dflash|rror'
        rm -f "$OUT/stream27b_$side"/bench.{md,png,partial.json}
        python3 tools/trace_summary.py "/tmp/traces27b/$side" --top 60 --by-kernel --json > "$OUT/kernels27b_$side.json"
      done
      python3 tools/trace_summary.py /tmp/traces27b/on --against /tmp/traces27b/off --top 40 | tee "$OUT/against27b.txt"
      ;;
    gdn_trace)
      log "27B rounds traced, ${GDN_TRACE_ARGS:-bf16}"
      # shellcheck disable=SC2086
      timeout -k 5 "${GDN_TRACE_LIMIT:-260}" python3 -m ddtree_jax.bench --shape qwen3.6-27b --modes ar,dflash,ddtree \
        --budgets 63 --repeats 3 --kernels pallas ${GDN_TRACE_ARGS:-} --trace /tmp/gdn_trace --out "$OUT/gdn_trace" 2>&1 \
        | grep -E '^\| (ar|dflash|ddtree)|rror'
      rm -f "$OUT/gdn_trace"/bench.{md,png,partial.json}
      python3 tools/trace_summary.py /tmp/gdn_trace --top 80 --by-kernel --json > "$OUT/kernels27b.json"
      python3 tools/trace_summary.py /tmp/gdn_trace --top 5 --sequence "${GDN_TRACE_SEQ:-300:120}" > "$OUT/seq27b.txt"
      tail -5 "$OUT/seq27b.txt"
      ;;
    barrier)
      # Would a layer in one persistent kernel (programs met at grid barriers) beat a launch per projection
      log "barrier probe"
      timeout -k 5 "${BARRIER_LIMIT:-240}" python3 tools/barrier_probe.py --out "$OUT/barrier" \
        ${BARRIER_CONFIGS:+--configs "$BARRIER_CONFIGS"} 2>&1 | grep -E '^\||rror'
      ;;
    *)
      echo "unknown step $step"; exit 2 ;;
  esac
done
log done
