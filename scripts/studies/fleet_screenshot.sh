#!/usr/bin/env bash
# Screenshot a `litevlm fleet compare` report in headless Chromium, to look at it as a person would:
#   bash scripts/studies/fleet_screenshot.sh REPORT_DIR [OUT.png] [WIDTHxHEIGHT]
# Chromium: `apt-get update && apt-get install -y chromium`. Its profile goes to a temporary folder.
set -euo pipefail
report="$(cd "$1" && pwd)"
out="${2:-$report/screenshot.png}"
size="${3:-1400,2000}"
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
[ -n "$browser" ] || { echo "no chromium: apt-get update && apt-get install -y chromium" >&2; exit 3; }
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
    --disable-sync --no-first-run --user-data-dir="$profile" --hide-scrollbars \
    --screenshot="$out" --window-size="${size/x/,}" "file://$report/index.html" >/dev/null 2>&1
[ -s "$out" ] || { echo "chromium wrote no screenshot" >&2; exit 1; }
echo "$out"
