#!/usr/bin/env bash
# Drafter data and training on one GPU, in one go (tried on an H100 with a 135M target):
#   1. generate more self-distilled data with wide static batches (training.distill --engine
#      static) for GEN_MIN minutes, starting after the shards of distill-v1, while distill-v1's
#      and the held-out run's hidden states are rebuilt from their committed ids (fp32 weights);
#   2. train EAGLE-2 and Lyanna from scratch, two learning rates each, side by side for
#      TRAIN_MIN minutes, keeping each run's best held-out evaluation.
# Outputs: data/distill/distill-v2 (ids, commit them), $EXPORT/<run> (checkpoints), $LOGS.
# Run from the repository root:  GEN_MIN=2 TRAIN_MIN=5 bash training/gpu_run.sh
set -u
export PYTHONUNBUFFERED=1
PY=${PY:-python3} DEVICE=${DEVICE:-cuda} BATCH=${BATCH:-768}
GEN_MIN=${GEN_MIN:-2} TRAIN_MIN=${TRAIN_MIN:-5}
LOGS=${LOGS:-runs/gpu/logs} EXPORT=${EXPORT:-runs/gpu/export}
mkdir -p "$LOGS" "$EXPORT"
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$LOGS/timeline.txt"; }
"$PY" -c "import lyanna, training" || { stamp "run from the repository root"; exit 1; }

timeout "$(awk "BEGIN{print int($GEN_MIN*60+180)}")" "$PY" -m training.distill generate \
    --run-name distill-v2 --engine static --device "$DEVICE" --weights fp32 --batch-size "$BATCH" \
    --start-shard 28 --token-budget 50000000 --max-minutes "$GEN_MIN" --threads 4 ${GEN_ARGS:-} \
    >"$LOGS/gen.log" 2>&1 &
GEN=$!
for run in distill-v1 distill-heldout-v1; do
    "$PY" -m training.distill materialize --run-name "$run" --device "$DEVICE" --threads 4 \
        >>"$LOGS/materialize.log" 2>&1 || stamp "materialize $run failed"
done
stamp "materialize done"
wait $GEN
stamp "generate done rc=$?"

DATA=distill-v1
CACHE=${LYANNA_CACHE:-$HOME/.cache/lyanna}
if "$PY" -c "import json, sys; m = json.load(open(sys.argv[1])); assert m['shards']" \
    "$CACHE/data/distill-v2/manifest.json" 2>/dev/null; then
    DATA=distill-v1,distill-v2
fi
stamp "training on $DATA"
PIDS=""
for spec in "eagle 1e-3 e1" "eagle 3e-3 e3" "lyanna 1e-3 l1" "lyanna 3e-3 l3"; do
    set -- $spec
    "$PY" -m training.train --model "$1" --data "$DATA" --val-data distill-heldout-v1 \
        --run-name "gpu-$3" --device "$DEVICE" --amp bf16 --lr "$2" --batch-tokens 16384 \
        --max-seq-len 1024 --warmup-steps 100 --max-steps 20000 --max-minutes "$TRAIN_MIN" \
        --eval-every 100 --log-every 50 --ckpt-every 100000 --keep-best true --threads 2 \
        --export-dir "$EXPORT/$3" >"$LOGS/train-$3.log" 2>&1 &
    PIDS="$PIDS $!"
done
wait $PIDS
stamp "training done"
