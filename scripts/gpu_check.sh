#!/usr/bin/env bash
# GPU check (needs an NVIDIA GPU and a CUDA build of PyTorch): InternVL2.5-2B-shaped random weights
# through the pipeline, eager vs CUDA-graph-captured, same tokens, per-stage table; then in-flight batching
# (batched steps captured per batch bucket) and its per-bucket table. See gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec timeout 420 "$PY" scripts/gpu_check.py "$@"
