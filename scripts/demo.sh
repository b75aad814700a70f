#!/usr/bin/env bash
# The main job, one command: set-up, make the small bundled model if absent, then ask it about
# six real camera frames and print the answer with its per-stage latency.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LITEVLM_VENV:-$ROOT/.venv}"
MODEL="${LITEVLM_MODEL:-$ROOT/runs/models/tiny}"
FRAMES="${LITEVLM_FRAMES:-$ROOT/../shared/drivelm_sample/samples}"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [ ! -f "$MODEL/config.json" ]; then
    echo "[demo] making the small model in $MODEL"
    "$VENV/bin/litevlm" make-checkpoint --preset tiny "$MODEL"
fi
"$VENV/bin/litevlm" ask --model "$MODEL" --frames "$FRAMES" \
    --question "What should the ego vehicle do at this junction?"
