"""`litevlm bench --study lowbit_decode` as a user runs it (issue 35's p99/p50 measurement): every form's rows,
a checkout's forms under --against from a child process that imports that checkout's package,
and the --plot PNG. Behaviour only: the figures themselves are the machine's."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

STUDY = [sys.executable, "-m", "litevlm_runtime.cli", "bench", "--study", "lowbit_decode"]


def test_forms_here_and_under_against_give_every_row(tmp_path):
    # A checkout of this very tree stands in for an older one: --against only needs a folder whose
    # package the child imports (PYTHONPATH), which the child's own module path then shows.
    png = tmp_path / "loaded.png"
    out = subprocess.run(
        [*STUDY, "--preset", "bundled", "--weights",
         "int4-rtn,float", "--threads", "1", "--hog", "1", "--steps", "3", "--rounds", "2",
         "--against", str(ROOT), "--against-weights", "int8", "--plot", str(png)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    name = ROOT.name
    assert f"--against: int8 from {ROOT}/litevlm_runtime" in out.stdout
    lines = out.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("weights ")) + 2   # past the dashes
    body = lines[first:lines.index("", first)]
    rows = {(line.split(c)[0].strip(), c.strip()) for line in body for c in (" quiet ", " loaded ") if c in line}
    assert rows == {(k, c) for k in ("int4-rtn", "float", f"int8 @{name}") for c in ("quiet", "loaded")}
    assert f"int4-rtn vs int8 @{name}" in out.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_against_a_folder_without_the_package_says_so(tmp_path):
    out = subprocess.run(
        [*STUDY, "--preset", "bundled", "--weights", "float",
         "--hog", "0", "--steps", "1", "--rounds", "1", "--against", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode != 0 and f"--against {tmp_path}" in out.stdout + out.stderr


def test_window_of_a_form_far_faster_than_float_stays_within_a_run():
    # int4 five times faster than float wants five-step windows; a run of three steps holds one
    # three-step window per round (the CI failure of 0bf4c0e: no windows, no median).
    from litevlm_runtime.bench.studies.lowbit_decode import window_rows

    samples = {("float", c): [50.0] * 6 for c in ("quiet", "loaded")}
    samples |= {("int4", c): [10.0] * 6 for c in ("quiet", "loaded")}
    rows = window_rows(["float", "int4"], samples, {"float": 50.0, "int4": 10.0}, steps=3)
    int4 = [r for r in rows if r[0] == "int4"]
    assert [(r[7], r[8]) for r in int4] == [(3, 2), (3, 2)]
