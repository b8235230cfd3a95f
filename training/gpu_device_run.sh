#!/usr/bin/env bash
# training/gpu_run.sh on a bare GPU machine that receives the repository in pieces (the one
# used here takes at most 64 MiB per call and has no network): the tracked tree without
# checkpoints/ and data/ (a throwaway branch), then two carried folders, G1 and G2:
#   G1: gguf.part1 (the first 56,000,000 bytes of the default model's GGUF), the gguf wheel,
#       modeldir.tar.xz (config, tokenizer files and marker of $LYANNA_CACHE/SmolLM2-135M-Instruct)
#   G2: gguf.part2 (the rest), distill-ids.tar (data/distill), train_prompts.jsonl.xz
# It joins and checks the GGUF (sha256), dequantizes it into the model cache (the tokenizer
# comes from the CPU's cache, not re-derived), unpacks the data, runs gpu_run.sh and packs the
# new ids, the exported checkpoints and the logs into $OUT (at most 8 files come back).
# INIT=committed (continue the committed checkpoints) needs checkpoints/eagle2-smollm2-135m and
# checkpoints/lyanna-smollm2-135m on the machine too (21.5 MB: a third piece).
# Used on 2026-11-26: docs in training/README.md ("On a GPU").
set -u
export PYTHONUNBUFFERED=1 LYANNA_NATIVE=0
export LYANNA_CACHE=${LYANNA_CACHE:-$HOME/.cache/lyanna}
G1=${G1:-.dev/g1} G2=${G2:-.dev/g2} OUT=${OUT:-runs/gpu/out}
SITE=${SITE:-$HOME/.cache/lyanna-site}  # where the carried gguf wheel is installed
t0=$(date +%s)
say() { echo "[stage $(($(date +%s) - t0))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $G1/gguf-*.whl || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
M=$LYANNA_CACHE/SmolLM2-135M-Instruct
mkdir -p "$LYANNA_CACHE/gguf" "$M" "$OUT"
GGUF=$LYANNA_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
cat $G1/gguf.part1 $G2/gguf.part2 > "$GGUF"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c - || exit 1
python3 -c "
import sys
from pathlib import Path
from lyanna.model.loader import export_hf_dir, read_gguf
config, state = read_gguf(sys.argv[1])
export_hf_dir(config, state, Path(sys.argv[2]))
" "$GGUF" "$M" || exit 1
tar xJf $G1/modeldir.tar.xz -C "$M" || exit 1   # tokenizer files and the marker, as made on the CPU
tar xf $G2/distill-ids.tar || exit 1
if [ ! -f ../shared/data/train_prompts.jsonl ]; then
    mkdir -p ../shared/data && xz -dc $G2/train_prompts.jsonl.xz > ../shared/data/train_prompts.jsonl || exit 1
fi
say "staged"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
bash training/gpu_run.sh
say "gpu_run done"
LOGS=${LOGS:-runs/gpu/logs} EXPORT=${EXPORT:-runs/gpu/export}
GEN_RUN=${GEN_RUN:-distill-v4}
[ -d "data/distill/$GEN_RUN" ] && tar cJf "$OUT/$GEN_RUN-ids.tar.xz" "data/distill/$GEN_RUN"
for d in "$EXPORT"/*/; do
    tag=$(basename "$d")
    [ -f "$d/model.safetensors" ] && cp "$d/model.safetensors" "$OUT/$tag.safetensors"
done
tar cJf "$OUT/meta.tar.xz" "$LOGS" $(ls "$EXPORT"/*/manifest.json "$EXPORT"/*/config.json 2>/dev/null) \
    $(ls "$LYANNA_CACHE"/data/*/manifest.json 2>/dev/null)
ls -la "$OUT"
for f in "$LOGS"/train-*.log; do echo "== $f"; grep -E '"val"|export' "$f" | tail -3 | cut -c1-600; done
tail -5 "$LOGS"/gen.log "$LOGS"/materialize-*.log 2>/dev/null | cut -c1-300
cat "$LOGS/timeline.txt"
say "packed"
