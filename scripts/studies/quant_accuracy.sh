#!/usr/bin/env bash
# Accuracy of quantized bundles against float on fresh SynthDrive questions (issue 36), one run at a
# time under `nice` (each is CPU-heavy: 4,287 questions at one thread), then the comparison tables
# with 95% intervals (`litevlm eval --compare`, evaluation/compare.py). Slow (hours on 2 shared
# cores): not part of CI. Every run's predictions are kept in $OUT; a run whose file exists is
# skipped, so the script resumes.
#
#   scripts/studies/quant_accuracy.sh OUT EVAL_DIR CAL NAME=BUNDLE_OR_torch[@RATIO][+FLAGS] ...
#
# e.g. scripts/studies/quant_accuracy.sh runs/q36 runs/data/s3636 runs/cal float=fp32@0.8 fp8=fp8@0.8 float9=fp32@0.9 fp8_9=fp8@0.9
# ACCURACY_ONLY=1: only the questions that can count for accuracy (`litevlm eval --accuracy-only`).
# BUNDLE is a folder under CAL (fp32, fp8, int8, ...) run by the onnxruntime backend, or `torch`
# (the PyTorch backend; `torch+--arena.kv_dtype int8` adds flags). Common settings: the deployed
# LiteVLM pipeline (views and tokens from the model folder) with greedy decoding, so that every
# run's answer depends on its numerics only (EAGLE-2's adaptive policy picks trees by measured
# time, and a quantized tree step rounds differently from the one-row step).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$1 EVAL=$2 CAL=$3
shift 3
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-litevlm_runtime/bundled/synthdrive-internvl2_5-v2}
DATA=${DATA:-$EVAL/train.json}
mkdir -p "$OUT"
for spec in "$@"; do
    name=${spec%%=*} rest=${spec#*=}
    flags=""
    [[ $rest == *+* ]] && flags=${rest#*+} && rest=${rest%%+*}
    bundle=${rest%%@*} ratio=0.8
    [[ $rest == *@* ]] && ratio=${rest#*@}
    pred=$OUT/$name.json
    [ -f "$pred" ] && { echo "[$name] $pred exists: skipped"; continue; }
    if [ "$bundle" = torch ]; then backend=(--backend.name torch)
    else backend=(--backend.name onnxruntime --backend.bundle "$CAL/$bundle"); fi
    echo "[$name] $bundle r=$ratio $flags ($(cat /proc/loadavg))"
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 nice "$PY" -m litevlm_runtime.cli eval --model "$MODEL" --data "$DATA" --frames "$EVAL" \
        "${backend[@]}" --backend.threads 1 --decoding.mode greedy --tokens.keep_ratio "$ratio" \
        ${ACCURACY_ONLY:+--accuracy-only} --predictions "$pred.tmp" $flags > "$OUT/$name.scores.txt"
    mv "$pred.tmp" "$pred"
done
