#!/usr/bin/env bash
# Issue 24: the demo drafter retrained from extracted features (README "Retraining the demo drafter"), then the
# shipped and the new drafter measured on held-out prompts 1-32. Meant for the H200, in its own process session
# (tools/h200_run.sh retrain_bg), since extraction + training + measurement take longer than one device call;
# `retrain_wait` collects $RETRAIN_DIR. Every stage appends to $RETRAIN_DIR/stages.log; `done` marks the end.
set -uo pipefail
R="${RETRAIN_DIR:-/tmp/retrain}"
W="$R/work"
mkdir -p "$W"
stage() { echo "== $* ($(date +%H:%M:%S))" | tee -a "$R/stages.log"; }
fail() { stage "failed: $*"; touch "$R/done"; exit 1; }
DEMO=ddtree_jax/assets/demo

stage "selection prompts: held-out 33-112"
sed -n '33,$p' "$DEMO/prompts.jsonl" > "$W/select_prompts.jsonl"

stage "extract"
python3 -m ddtree_jax.train.extract --target "$DEMO/target" --out "$W/demo_features" --include-tests \
  --sequences "${RETRAIN_SEQUENCES:-49152}" --prompt-len 128 --gen-len 192 --batch 1024 --shard-sequences 1024 \
  --dtype float32 || fail extract

stage "train"
python3 -m ddtree_jax.train.drafter --features "$W/demo_features" --out "$R/drafter" --work "$W/drafter.train" \
  --dtype float32 --layers 2 --batch 64 --anchors 16 --lr 1.5e-3 --warmup 200 --minutes "${RETRAIN_MINUTES:-5}" \
  --eval-every 1000 --eval-prompts "$W/select_prompts.jsonl" --eval-decode 80 --eval-new-tokens 128 --select tau \
  --patience 4 --save-every 100000 --log-every 200 --check-prompts 0 || fail train
cp "$W/drafter.train/log.json" "$R/train_log.json"
cp "$W/drafter.train/loss.png" "$R/loss.png"
cp "$W/drafter.train/acceptance.png" "$R/acceptance.png"
tar -C "$R" -cf "$R/drafter.tar" drafter

for which in shipped new; do
  stage "bench: the $which drafter on held-out prompts 1-32"
  drafter="$DEMO/drafter"; [ "$which" = new ] && drafter="$R/drafter"
  python3 -m ddtree_jax.bench --target "$DEMO/target" --drafter "$drafter" --prompts "$DEMO/prompts.jsonl" \
    --num-prompts 32 --max-new-tokens 128 --budgets 16,64,256 --modes dflash,ddtree --dtype float32 \
    --out "$W/bench_$which" 2>&1 | grep -E "^\||error" | tail -8
  cp "$W/bench_$which/bench.json" "$R/bench_$which.json"
done
stage "done"
touch "$R/done"
