#!/usr/bin/env bash
# The test command: set-up (skipped when up to date), then the test suite. Arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LITEVLM_VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
rc=0
# --durations: the slowest tests at the end of every run (the suite must stay under 20 min in CI).
"$VENV/bin/python" -m pytest --durations=30 "$@" || rc=$?
# pytest exits 5 when it collected no tests (e.g. a -k that matches nothing): not a failure.
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
