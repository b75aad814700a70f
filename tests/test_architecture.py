"""The package's layers and its freedom from import cycles, as written in .importlinter, checked
with import-linter (a well-kept tool for exactly this): on the package as it is, and on a copy
with a planted upward import and a planted cycle, so that the check is shown able to fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [str(Path(sys.executable).with_name("lint-imports")), "--config", str(root / ".importlinter")]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_contracts_are_kept():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 kept, 0 broken" in run.stdout


def test_an_upward_import_or_a_cycle_breaks_them(tmp_path):
    shutil.copytree(ROOT / "litevlm_runtime", tmp_path / "litevlm_runtime",
                    ignore=shutil.ignore_patterns("__pycache__", "bundled"))
    (tmp_path / "litevlm_runtime" / "bundled").mkdir()
    (tmp_path / "litevlm_runtime" / "bundled" / "__init__.py").write_text("")
    shutil.copy(ROOT / ".importlinter", tmp_path)
    rope = tmp_path / "litevlm_runtime" / "models" / "rope.py"
    rope.write_text(rope.read_text() + "\nfrom ..pipeline import runtime  # planted: models import the pipeline\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0 and "litevlm_runtime.models.rope -> litevlm_runtime.pipeline.runtime" in run.stdout, (
        run.stdout
    )
    assert "0 broken" not in run.stdout

    rope.write_text(rope.read_text().replace("from ..pipeline import runtime", "from . import decoder"))
    run = lint_imports(tmp_path)     # decoder imports rope: a cycle inside models/
    assert run.returncode != 0 and "No import cycles" in run.stdout and "BROKEN" in run.stdout, run.stdout
