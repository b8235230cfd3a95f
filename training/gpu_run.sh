#!/usr/bin/env bash
# Drafter data and training on one GPU, in one go (run on an H100 with the 135M target):
#   1. the hidden states of the committed id runs ($MATERIALIZE) are rebuilt on the GPU from
#      their ids (fp32 weights), one process per run, while a new run ($GEN_RUN, from shard
#      $GEN_START of the train split) is generated with wide static batches for GEN_MIN
#      minutes (GEN_MIN=0: no generation);
#   2. $TRAIN_SPECS (model, learning rate, token-loss weight, tag) are trained side by side
#      for TRAIN_MIN minutes on every run with hidden states, each keeping its best held-out
#      evaluation; from the committed checkpoints with INIT=committed (continuing their
#      training, their hot vocabularies kept), from scratch with INIT=scratch (the default).
# Memory: a Lyanna run at 16,384-token batches took 47.6 GB of an H100 where an EAGLE-2 run
# took 11.4 GB (it keeps fp32 [rows, 8192] token-info and loss tensors per unrolled step), so
# the fourth of four runs (Lyanna at lr 1.5e-3) ran out of memory on 2026-11-26: give Lyanna
# runs smaller BATCH_TOKENS or fewer neighbours.
# Outputs: data/distill/$GEN_RUN (ids: commit them), $EXPORT/<tag> (checkpoints), $LOGS.
# Run from the repository root:  GEN_MIN=1.5 TRAIN_MIN=4.5 bash training/gpu_run.sh
set -u
export PYTHONUNBUFFERED=1
PY=${PY:-python3} DEVICE=${DEVICE:-cuda} BATCH=${BATCH:-768}
GEN_MIN=${GEN_MIN:-1.5} TRAIN_MIN=${TRAIN_MIN:-4.5}
MATERIALIZE=${MATERIALIZE:-distill-v1 distill-v2 distill-v3 distill-heldout-v1}
GEN_RUN=${GEN_RUN:-distill-v4} GEN_START=${GEN_START:-93}
DATA=${DATA:-distill-v1,distill-v2,distill-v3} VAL=${VAL:-distill-heldout-v1}
TRAIN_SPECS=${TRAIN_SPECS:-"eagle 6e-4 0.2 e6 eagle 1.5e-3 0.2 e15 lyanna 6e-4 1.0 l6 lyanna 1.5e-3 1.0 l15"}
# extra training.train flags of the Lyanna runs: by default the copy read (the 29th session's
# best at 2M on the CPU, +0.20-0.24 held-out top-1 over EAGLE-2 on two seeds; INIT=committed
# continues a copy checkpoint, or a copy-less one with the read's scale at zero); "" for none
LYANNA_FLAGS=${LYANNA_FLAGS---info-copy true}
BATCH_TOKENS=${BATCH_TOKENS:-16384} EVAL_EVERY=${EVAL_EVERY:-100} INIT=${INIT:-scratch}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
LOGS=${LOGS:-runs/gpu/logs} EXPORT=${EXPORT:-runs/gpu/export}
CACHE=${LYANNA_CACHE:-$HOME/.cache/lyanna}
mkdir -p "$LOGS" "$EXPORT"
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$LOGS/timeline.txt"; }
"$PY" -c "import lyanna, training" || { stamp "run from the repository root"; exit 1; }

GEN=""
if [ "$(awk "BEGIN{print ($GEN_MIN > 0)}")" = 1 ]; then
    timeout "$(awk "BEGIN{print int($GEN_MIN*60+90)}")" "$PY" -m training.distill generate \
        --run-name "$GEN_RUN" --engine static --device "$DEVICE" --weights fp32 \
        --batch-size "$BATCH" --start-shard "$GEN_START" --token-budget 50000000 \
        --max-minutes "$GEN_MIN" --threads 4 ${GEN_ARGS:-} >"$LOGS/gen.log" 2>&1 &
    GEN=$!
fi
MAT=""
for run in $MATERIALIZE; do
    "$PY" -m training.distill materialize --run-name "$run" --device "$DEVICE" --threads 2 \
        >"$LOGS/materialize-$run.log" 2>&1 &
    MAT="$MAT $!"
done
for pid in $MAT; do wait "$pid" || stamp "a materialize job failed (rc=$?)"; done
stamp "materialize done"
if [ -n "$GEN" ]; then
    wait "$GEN"
    stamp "generate done rc=$?"
    if "$PY" -c "import json, sys; m = json.load(open(sys.argv[1])); assert m['shards']" \
        "$CACHE/data/$GEN_RUN/manifest.json" 2>/dev/null; then
        DATA="$DATA,$GEN_RUN"
    fi
fi

stamp "training on $DATA"
PIDS=""
set -- $TRAIN_SPECS
while [ $# -ge 4 ]; do
    FROM=""
    [ "$1" = lyanna ] && FROM="$LYANNA_FLAGS"
    if [ "$INIT" = committed ]; then
        FROM="$FROM --init-from checkpoints/$([ "$1" = eagle ] && echo eagle2 || echo "$1")-smollm2-135m"
    fi
    "$PY" -m training.train --model "$1" --data "$DATA" --val-data "$VAL" \
        --run-name "gpu-$4" --device "$DEVICE" --amp bf16 --lr "$2" --ce-weight "$3" \
        --batch-tokens "$BATCH_TOKENS" --max-seq-len 1024 --warmup-steps 100 \
        --max-steps 100000 --max-minutes "$TRAIN_MIN" --eval-every "$EVAL_EVERY" \
        --log-every 50 --ckpt-every 1000000 --keep-best true --threads 2 \
        --export-dir "$EXPORT/$4" $FROM >"$LOGS/train-$4.log" 2>&1 &
    PIDS="$PIDS $!"
    shift 4
done
for pid in $PIDS; do wait "$pid" || stamp "a training run failed (rc=$?)"; done
stamp "training done"
