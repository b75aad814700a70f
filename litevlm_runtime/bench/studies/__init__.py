"""Measuring studies: one question each, asked again whenever the code under it changes, each a
module with its own flags and `main(argv)`. `litevlm bench --study NAME [its flags]` runs one
(`litevlm bench --study list` lists them; `litevlm bench --study NAME --help` shows its flags).

They are modules of the package, not scripts beside it, so that they run against the installed
package as `litevlm` does, and their tests drive the same entry a user types. One-off studies that
answered a question once live in scripts/studies/ (its README says where each answer is written up).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
import textwrap
from pathlib import Path

from ...errors import InputError

HERE = Path(__file__).resolve().parent


def studies() -> dict[str, str]:
    """Study name -> the first clause of its docstring (without parentheses), read from the source: listing them
    imports none (most load torch)."""
    found = {}
    for info in sorted(pkgutil.iter_modules([str(HERE)]), key=lambda m: m.name):
        doc = ast.get_docstring(ast.parse((HERE / f"{info.name}.py").read_text())) or ""
        first = re.split(r": |\. ", " ".join(doc.split("\n\n")[0].split()))[0]
        found[info.name] = re.sub(r" \([^)]*\)", "", first).rstrip(".:")
    return found


def study_list() -> str:
    rows = []
    for name, what in studies().items():
        rows.append(textwrap.fill(what, width=100, initial_indent=f"  {name:<17}", subsequent_indent=" " * 19))
    return "studies (litevlm bench --study NAME --help: its flags):\n" + "\n".join(rows)


def run_study(argv: list[str]) -> int:
    """`litevlm bench --study NAME ARGS...`: NAME's main(ARGS); no NAME, `list` or --help: the list."""
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(study_list())
        return 0
    name, rest = argv[0], argv[1:]
    known = studies()
    if name not in known:
        raise InputError(f"--study {name}: no such study (one of: {', '.join(known)}; litevlm bench --study list)")
    module = importlib.import_module(f"{__name__}.{name}")
    # The study's argparse names its program after sys.argv[0]: the command that ran it, in its usage.
    argv0, sys.argv[0] = sys.argv[0], f"litevlm bench --study {name}"
    try:
        return int(module.main(rest) or 0)
    finally:
        sys.argv[0] = argv0
