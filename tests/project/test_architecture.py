"""The package's layers and its freedom from import cycles, as written in .importlinter, checked
with import-linter (a well-kept tool for exactly this): on the package as it is, and on a copy
with a planted upward import and a planted cycle, so that the check is shown able to fail; and
docs/architecture.md's layer list, which must be .importlinter's."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def importlinter_layers(text: str) -> list[set[str]]:
    """The layers contract's layers, top first, each as the set of its modules."""
    config = configparser.ConfigParser()
    config.read_string(text)
    lines = config["importlinter:contract:layers"]["layers"].split("\n")
    return [{m.strip() for m in line.split("|")} for line in lines if line.strip()]


def documented_layers(text: str) -> list[set[str]]:
    """docs/architecture.md's list: the code block under "## Layers", a layer per line, its modules
    before the first run of two or more spaces (what follows is what the layer holds)."""
    section = text.split("\n## Layers\n", 1)[1]
    block = section.split("```\n", 2)[1]
    return [{m.strip() for m in re.split(r"\s{2,}", line.strip())[0].split("|")}
            for line in block.splitlines() if line.strip()]


def test_the_documented_layers_are_the_contracts():
    contract = importlinter_layers((ROOT / ".importlinter").read_text())
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert documented_layers(doc) == contract, "docs/architecture.md's layer list differs from .importlinter's"
    # the check fails when a layer is added to one and not the other
    added = doc.replace("\nbag  ", "\nfleet2\nbag  ", 1)
    assert documented_layers(added) != contract and len(documented_layers(added)) == len(contract) + 1
