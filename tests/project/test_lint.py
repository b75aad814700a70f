"""The lint rules of ruff.toml (unused and undefined names, import order, lines of at most 120
characters, whitespace; at most 8 arguments, 50 statements a function, imports at the top unless the
file says why) hold over the package, the tests, the scripts, the launch file and setup.py; and a
planted long line, a planted 9-argument function, a long function and an inline import break them,
so the checks are live."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_ruff_check_passes():
    r = ruff("litevlm_runtime", "tests", "scripts", "launch", "setup.py")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_a_line_over_120_characters_fails(tmp_path):
    bad = tmp_path / "long.py"
    bad.write_text("X = " + repr("x" * 130) + "\n")
    r = ruff("--config", str(ROOT / "ruff.toml"), str(bad))
    assert r.returncode == 1 and "E501" in r.stdout, r.stdout


def test_the_structure_gates_are_live(tmp_path):
    """PLR0913 (more than 8 arguments), PLR0915 (more than 50 statements), PLC0415 (an import inside
    a function) fire on a file that no per-file ignore covers."""
    bad = tmp_path / "structure.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(51))
    bad.write_text("def nine(a, b, c, d, e, f, g, h, i):\n    return a\n\n\n"
                   f"def long():\n{body}    return x0\n\n\n"
                   "def inline():\n    import json\n\n    return json\n")
    r = ruff("--config", str(ROOT / "ruff.toml"), str(bad))
    assert r.returncode == 1, r.stdout
    for rule in ("PLR0913", "PLR0915", "PLC0415"):
        assert rule in r.stdout, (rule, r.stdout)
