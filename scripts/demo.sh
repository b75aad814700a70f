#!/usr/bin/env bash
# The main job, one command: the LiteVLM ROS 2 node answering questions about six camera streams.
#   1. set-up (skipped when up to date)
#   2. the model: $LITEVLM_MODEL, else the bundled SynthDrive model (litevlm_runtime/bundled/,
#      trained by `litevlm train vlm`; see its MODEL_CARD.md)
#   3. a bag: six camera streams + DriveLM questions from ../shared/drivelm_sample, or, when that
#      is absent, from SynthDrive frames rendered here (`litevlm synth`)
#   4. `litevlm drive` (the node), `litevlm bag record`, `litevlm bag replay`: three processes
#      talking over DDS on loopback
#   5. each answer with its per-stage latency, then median/p90 per stage and the transport's share
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LITEVLM_VENV:-$ROOT/.venv}"
MODEL="${LITEVLM_MODEL:-$ROOT/litevlm_runtime/bundled/synthdrive-internvl2_5-v2}"
DRIVELM="${LITEVLM_DRIVELM:-$ROOT/../shared/drivelm_sample}"
WORK="$ROOT/runs/demo"
L="$VENV/bin/litevlm"

bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
mkdir -p "$WORK"
if [ ! -f "$MODEL/config.json" ]; then
    echo "[demo] no model at $MODEL (set LITEVLM_MODEL to an InternVL2.5 folder)" >&2
    exit 2
fi

BAG="$WORK/drive_bag"   # a rosbag2 folder (a name ending .bag would read as ROS 1)
rm -rf "$BAG"
if [ -d "$DRIVELM/samples" ]; then
    echo "[demo] bag from the DriveLM sample ($DRIVELM)"
    "$L" bag make --from-drivelm "$DRIVELM" --out "$BAG" ${LITEVLM_BAG_ARGS:-}
else
    echo "[demo] ../shared/drivelm_sample is absent: rendering SynthDrive frames instead"
    rm -rf "$WORK/synth"
    "$L" synth --out "$WORK/synth" --scenes 6 --width 800 --height 450 --quiet
    "$L" bag make --from-synth "$WORK/synth" --out "$BAG" ${LITEVLM_BAG_ARGS:-}
fi
N_QUERIES="$("$VENV/bin/python" -c "
import sys
from litevlm_runtime.bag.io import read_bag
print(sum(1 for _, topic, *_ in read_bag(sys.argv[1]) if topic == '/litevlm/query'))" "$BAG")"

# Own DDS domain (unless set), and the large-data Fast DDS profile for all three processes.
export ROS_DOMAIN_ID="${ROS_DOMAIN_ID:-$(( ($$ % 100) + 100 ))}"
export FASTDDS_DEFAULT_PROFILES_FILE="${FASTDDS_DEFAULT_PROFILES_FILE:-$ROOT/config/fastdds_large_data.xml}"
NODE_PID="" ; REC_PID=""
cleanup() {
    for pid in $REC_PID $NODE_PID; do kill -INT "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

echo "[demo] starting the node (log: $WORK/node.log), domain $ROS_DOMAIN_ID"
"$L" drive --set "model_dir=$MODEL" > "$WORK/node.log" 2>&1 &
NODE_PID=$!
"$L" bag record --out "$WORK/answers.jsonl" --count "$N_QUERIES" --timeout 900 > "$WORK/record.log" 2>&1 &
REC_PID=$!
for _ in $(seq 600); do
    grep -q "ready (" "$WORK/node.log" && break
    kill -0 "$NODE_PID" 2>/dev/null || { cat "$WORK/node.log"; echo "[demo] the node exited" >&2; exit 1; }
    sleep 0.5
done
grep -q "ready (active)" "$WORK/node.log" || { cat "$WORK/node.log"; echo "[demo] the node is not active" >&2; exit 1; }
echo "[demo] node active; replaying $N_QUERIES questions"
"$L" bag replay "$BAG"
wait "$REC_PID" || { cat "$WORK/record.log"; echo "[demo] not every question was answered" >&2; exit 1; }
REC_PID=""
"$L" bag summary "$WORK/answers.jsonl"
echo "[demo] answers: $WORK/answers.jsonl   node log: $WORK/node.log"
