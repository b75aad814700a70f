"""`litevlm --help` and every sub-command's parser build without loading torch or rclpy (cli.py:
a command imports what it runs inside its `run`; the parser's choices come from light modules such
as options.py), so that a mistyped flag is answered at once and the help prints in a blink."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import contextlib, io, sys
from litevlm_runtime import cli
for argv in (["--help"], ["bench", "--help"], ["train", "views", "--help"], ["eval-views", "--help"],
             ["make-checkpoint", "--help"], ["train", "vlm", "--help"]):
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main(argv)
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
print(sorted(m for m in ("torch", "rclpy", "onnxruntime", "transformers") if m in sys.modules))
"""


def test_the_parser_loads_neither_torch_nor_rclpy():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
