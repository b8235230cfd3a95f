#!/usr/bin/env bash
# The GPU checks of one short device session, in order of priority under one deadline: this
# engine's decode / verify steps against transformers (random weights, bench.device_peers),
# the CUDA tests, Spec-Bench in bf16 and float32 at T = 0 and in bf16 at T = 1, the split services
# against embedded, each output a file under $OUT. Run from the repository root on a machine
# with one GPU, the default model in $LYANNA_CACHE and the checkpoints in checkpoints/ (all in
# the same call: on the lent machines here, a carried folder does not outlive the next call,
# which cost the 2026-11-27 session its float32 and T = 1 runs). How the machine here was fed
# (the GGUF in two calls under the 64 MiB limit): training/gpu_device_run.sh.
#   BUDGET_S=540 OUT=/tmp/out bash bench/gpu_checks.sh
# (the services' packages the image lacks: run bench/gpu_wheels.sh here first and carry .whl)
# (DEVICE=cpu TOKENS=8 runs the same steps on a CPU in a few minutes: a check of the script)
set -u
export PYTHONUNBUFFERED=1 LYANNA_NATIVE=0
BUDGET_S=${BUDGET_S:-540} OUT=${OUT:-runs/gpu-checks} TOKENS=${TOKENS:-64} DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
if [ -d .whl ]; then  # the packages the image lacks (bench/gpu_wheels.sh), carried as wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
t0=$(date +%s)
END=$((t0 + BUDGET_S))
say() { echo "[$(($(date +%s) - t0))s] $*" | tee -a "$OUT/timeline.txt"; }
left() { # seconds for the next run: at most $1, at most what the deadline leaves
    local l=$((END - $(date +%s)))
    [ "$l" -gt "$1" ] && l=$1
    echo "$l"
}
run() { # name max_seconds command...: runs when at least 30 s are left
    local name=$1 l
    l=$(left "$2")
    shift 2
    [ "$l" -lt 30 ] && { say "$name: skipped (${l} s left)"; return; }
    say "$name (${l} s)"
    timeout "$l" "$@" >"$OUT/$name.txt" 2>&1
    say "$name: rc=$?"
}
for m in eagle2 lyanna ngram; do
    [ -f "checkpoints/$m-smollm2-135m/manifest.json" ] || say "checkpoints/$m-smollm2-135m is missing"
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee -a "$OUT/timeline.txt"
SHAPE=${SHAPE:-default}  # DEVICE=cpu SHAPE=tiny: the same steps in seconds
run engine_vs_peers 150 python3 -m bench.engine_vs_peers --device "$DEVICE" --dtype bf16 \
    --shape "$SHAPE" --batches 1 16 64 --max-tokens 128
SB=(python3 -m bench.spec_bench --limit-per-category 1 --max-tokens "$TOKENS" --device "$DEVICE")
run cuda_tests 120 python3 -m pytest -q -p no:cacheprovider -k "cuda or on_a_gpu" \
    tests/unit/test_drafters_on_device.py tests/services/test_placement.py \
    tests/unit/test_train_loop.py tests/unit/test_static_batch.py tests/unit/test_static_step.py \
    tests/unit/test_static_draft.py
run spec_bench_bf16_t0 120 "${SB[@]}" --methods ar,ngram,eagle,lyanna --dtype bf16
run serving_bf16 170 python3 -m bench.serving --deployments embedded services \
    --concurrency 1 4 16 --requests 24 --max-tokens "$TOKENS" \
    --serve-flags "--device $DEVICE --dtype bf16"
run spec_bench_fp32_t0 100 "${SB[@]}" --methods ar,ngram,eagle,lyanna --dtype float32
run spec_bench_bf16_t1 100 "${SB[@]}" --methods ar,ngram,eagle,lyanna --dtype bf16 \
    --temperature 1
cp "${LYANNA_CACHE:-$HOME/.cache/lyanna}/calibration.json" "$OUT/" 2>/dev/null
say done
