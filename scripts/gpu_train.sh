#!/usr/bin/env bash
# Train a SynthDrive model on a GPU in one call of at most 10 minutes (the lent H200), or, with the
# same commands, on the CPU (the test suite runs it so, at toy size).
#
#   1. a fresh SynthDrive training set: SCENES scenes of seed SEED (default 2027, so that none of
#      them is a scene of the bundled model's evaluation split, seed 2026 scenes 2850-2999);
#      rendering runs on every core
#   2. `litevlm train vlm --device auto --time-budget MINUTES` from scratch (PRESET), or from INIT
#      (at TILE_SIZE if set), with the vision labels and the bundled view selector, as the bundled
#      model's stage 3 was trained
#   3. the checkpoint (float32 safetensors, config, tokenizer, training record) and the log in
#      OUT_DIR; with TRANSFER_DIR set, also packed there as tar parts of at most 15 MiB (a device
#      call returns at most 8 files of 16 MiB; the `small` preset's weights alone are 18.6 MB).
#      Unpack with: cat model.tar.part-* | tar -xf - -C DEST
#
# It evaluates nothing: `litevlm eval` on the seed-2026 validation split, and training the
# EAGLE-2 head and token selector for the new model, run on the CPU afterwards (MODEL_CARD.md).
#
#   device run:  TRANSFER_DIR=$OUT bash scripts/gpu_train.sh                   (timeout_s 600)
#   CPU smoke:   SCENES=6 VAL_FRACTION=0.2 MINUTES=0.05 PRESET=tiny WIDTH=160 HEIGHT=90 OUT_DIR=/tmp/g bash scripts/gpu_train.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3                  # the device machine's python3 holds a CUDA PyTorch
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

SCENES=${SCENES:-6000}
SEED=${SEED:-2027}
VAL_FRACTION=${VAL_FRACTION:-0.02}
WIDTH=${WIDTH:-480}
HEIGHT=${HEIGHT:-270}
PRESET=${PRESET:-small}                     # 224 px tiles (64 visual tokens per camera)
INIT=${INIT:-}                              # continue from this checkpoint (its preset as PRESET) ...
TILE_SIZE=${TILE_SIZE:-}                    # ... optionally at another tile size (--tile-size)
MINUTES=${MINUTES:-6}                       # training time; set-up and decoding come on top
FRAMES_PER_STEP=${FRAMES_PER_STEP:-64}
LR=${LR:-2e-3}
OUT_DIR=${OUT_DIR:-runs/gpu_train}
DATA=${DATA:-/tmp/synthdrive-s$SEED-$SCENES-${WIDTH}x$HEIGHT}
BUNDLED=litevlm_runtime/bundled/synthdrive-internvl2_5-3m
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/train.log"

"$PY" - <<'EOF' | tee "$LOG"
import os, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"[gpu_train] torch {torch.__version__}, GPU {gpu}, {os.cpu_count()} cores")
EOF

if [ ! -f "$DATA/train.json" ]; then
    echo "[gpu_train] rendering $SCENES SynthDrive scenes (seed $SEED, ${WIDTH}x$HEIGHT) into $DATA" | tee -a "$LOG"
    "$PY" -m litevlm_runtime.cli synth --out "$DATA" --scenes "$SCENES" --seed "$SEED" --width "$WIDTH" \
        --height "$HEIGHT" --val-fraction "$VAL_FRACTION" 2>&1 | tr '\r' '\n' | grep -v '^synth: ' | tee -a "$LOG"
fi

# No --holdout frames of the training set: --val is the set's own VAL_FRACTION (seed SEED), for the periodic
# check only; the real evaluation is `litevlm eval` on the seed-2026 split afterwards.
"$PY" -m litevlm_runtime.cli train vlm --data "$DATA/train.json" --frames "$DATA" --val "$DATA/val.json" \
    --out "$OUT_DIR/model" --preset "$PRESET" --vocab-size 1024 --device auto --time-budget "$MINUTES" \
    ${INIT:+--init "$INIT"} ${TILE_SIZE:+--tile-size "$TILE_SIZE"} \
    --frames-per-step "$FRAMES_PER_STEP" --questions-per-frame 12 --questions-per-visit 12 \
    --max-sequence-tokens 2048 --loss-per sample --lr "$LR" --warmup 0.05 --max-answer-tokens 64 \
    --vision-labels "$DATA/ground_truth.json" --vision-weight 0.3 \
    --view-selector "$BUNDLED/view_selector" --selected-views 0.5 --seed 2 --log-every 20 \
    --eval-every 0 --eval-questions 192 2>&1 | tee -a "$LOG"
echo "[gpu_train] done: $OUT_DIR/model" | tee -a "$LOG"
if [ -n "${TRANSFER_DIR:-}" ]; then
    mkdir -p "$TRANSFER_DIR"
    tar -C "$OUT_DIR" -cf - model | split -b 15m -d - "$TRANSFER_DIR/model.tar.part-"
    cp "$LOG" "$TRANSFER_DIR/train.log"
    ls -l "$TRANSFER_DIR"
fi
