"""The lint rules of ruff.toml (unused and undefined names, import order, lines of at most 120
characters, whitespace) hold over the package, the tests and the scripts; and a planted long line
breaks them, so the check is live."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_ruff_check_passes():
    r = ruff("litevlm_runtime", "tests", "scripts")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_a_line_over_120_characters_fails(tmp_path):
    bad = tmp_path / "long.py"
    bad.write_text("X = " + repr("x" * 130) + "\n")
    r = ruff("--config", str(ROOT / "ruff.toml"), str(bad))
    assert r.returncode == 1 and "E501" in r.stdout, r.stdout
