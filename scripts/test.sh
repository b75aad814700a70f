#!/usr/bin/env bash
# The test command: set-up (skipped when up to date), then the test suite. Arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LITEVLM_VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
rc=0
# --durations: the slowest tests at the end of every run (the suite must stay under 20 min in CI).
# Two workers, a test file per worker at a time (--dist loadfile keeps a module's fixtures, e.g. an
# exported bundle, built once): most of the suite waits on DDS and on subprocesses it starts, so
# two cores run it in about 0.85x the time of one worker even beside other jobs (1425 against 1671 s
# at load 5, 2026-12-04), and every test then runs beside another: what CI's loaded cores do anyway.
# LITEVLM_TEST_WORKERS=0 runs it in one process.
"$VENV/bin/python" -m pytest -n "${LITEVLM_TEST_WORKERS:-2}" --dist loadfile --durations=30 "$@" || rc=$?
# pytest exits 5 when it collected no tests (e.g. a -k that matches nothing): not a failure.
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
