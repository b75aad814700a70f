#!/usr/bin/env bash
# Train the bundled model v2 on a GPU in one call of at most 10 minutes (the lent H200), or, with
# the same commands, on the CPU (the test suite runs it so, at toy size).
#
#   1. a fresh SynthDrive training set: SCENES scenes of seed SEED (default 2027: none of them is a
#      scene of the bundled model's honest evaluation seed 2029), each rendered at one of SIZES
#      (mixed resolutions, so that the vision does not depend on the camera's image size);
#      rendering runs on every core
#   2. `litevlm train vlm --device auto --time-budget MINUTES` at PRESET (default `bundled-v2`:
#      the bundled model's shape, 224 px tiles, 12 decoder layers) from scratch, or from INIT
#      (DECODER_LAYERS grows a shallower INIT, as v2 grew from v1; TILE_SIZE if set), with the
#      vision labels and the bundled view selector, as the bundled model was trained
#   3. the checkpoint (float32 safetensors, config, tokenizer, training record) and the log in
#      OUT_DIR; with TRANSFER_DIR set, also packed there as tar parts of at most 15 MiB (a device
#      call returns at most 8 files of 16 MiB).
#      Unpack with: cat model.tar.part-* | tar -xf - -C DEST
#
# It evaluates nothing: `litevlm eval` on seed 2029, and training the EAGLE-2 head and token
# selector for the new model, run on the CPU afterwards (the bundled MODEL_CARD.md).
#
#   device run:  TRANSFER_DIR=$OUT bash scripts/gpu_train.sh                   (timeout_s 600)
#   continue v2: INIT=litevlm_runtime/bundled/synthdrive-internvl2_5-v2 TRANSFER_DIR=$OUT bash scripts/gpu_train.sh
#   CPU smoke:   SCENES=6 VAL_FRACTION=0.2 MINUTES=0.05 PRESET=tiny SIZES=160x90,224x126 OUT_DIR=/tmp/g bash scripts/gpu_train.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3                  # the device machine's python3 holds a CUDA PyTorch
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

SCENES=${SCENES:-6000}
SEED=${SEED:-2027}
VAL_FRACTION=${VAL_FRACTION:-0.02}
SIZES=${SIZES:-480x270,800x450,1600x900}    # each scene at one of these
PRESET=${PRESET:-bundled-v2}                # 224 px tiles (64 visual tokens per camera), 12 decoder layers
DECODER_LAYERS=${DECODER_LAYERS:-}          # another depth than the preset's; a shallower INIT is grown to it
INIT=${INIT:-}                              # continue from this checkpoint ...
TILE_SIZE=${TILE_SIZE:-}                    # ... optionally at another tile size (--tile-size)
MINUTES=${MINUTES:-6}                       # training time; set-up and decoding come on top
FRAMES_PER_STEP=${FRAMES_PER_STEP:-64}
LR=${LR:-2e-3}
OUT_DIR=${OUT_DIR:-runs/gpu_train}
DATA=${DATA:-/tmp/synthdrive-s$SEED-$SCENES-${SIZES//,/-}}
BUNDLED=$("$PY" -c "from litevlm_runtime.bundled import DEFAULT_MODEL; print(DEFAULT_MODEL)")
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/train.log"

"$PY" - <<'EOF' | tee "$LOG"
import os, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"[gpu_train] torch {torch.__version__}, GPU {gpu}, {os.cpu_count()} cores")
EOF

if [ ! -f "$DATA/train.json" ]; then
    echo "[gpu_train] rendering $SCENES SynthDrive scenes (seed $SEED, sizes $SIZES) into $DATA" | tee -a "$LOG"
    "$PY" -m litevlm_runtime.cli synth --out "$DATA" --scenes "$SCENES" --seed "$SEED" --sizes "$SIZES" \
        --val-fraction "$VAL_FRACTION" 2>&1 | tr '\r' '\n' | grep -v '^synth: ' | tee -a "$LOG"
fi

# No --holdout frames of the training set: --val is the set's own VAL_FRACTION (seed SEED), for the periodic
# check only; the real evaluation is `litevlm eval` on seed 2029 afterwards.
"$PY" -m litevlm_runtime.cli train vlm --data "$DATA/train.json" --frames "$DATA" --val "$DATA/val.json" \
    --out "$OUT_DIR/model" --preset "$PRESET" --vocab-size 1024 --device auto --time-budget "$MINUTES" \
    ${INIT:+--init "$INIT"} ${TILE_SIZE:+--tile-size "$TILE_SIZE"} ${DECODER_LAYERS:+--decoder-layers "$DECODER_LAYERS"} \
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
