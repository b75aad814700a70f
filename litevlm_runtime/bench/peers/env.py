"""Where the peer engines live and the environment their processes start with.

A peer row runs as a standalone script (run_llama_cpp.py, run_openvino.py) in a process that
never imports this package: this package sets OMP_WAIT_POLICY=PASSIVE at import (threads.py) and
its parent process carries it, so the child's environment is this process's with every OpenMP /
MKL / thread variable removed (OMP_*, KMP_*, MKL_*, GOMP_*, LITEVLM_*), and without the library
directories the ROS wheels' bootstrapper put on LD_LIBRARY_PATH (the child is told the bootstrap
is done, so it is not re-executed with them). Each peer then runs at its own defaults with only
its thread count set through its own API; each child reports what it inherited and which OpenMP
runtime it loaded, and the table prints it.

Layout made by `bash scripts/setup.sh --peers` (requirements-peers.txt):
- llama-cpp-python with libmtmd, in this venv; the llama.cpp source tree it vendors (converter,
  gguf-py) in `<venv>/share/litevlm-peers/llama.cpp`;
- OpenVINO GenAI, optimum-intel and their pins in their own venv, `<repo>/.venv-openvino`
  (optimum-intel pins transformers < 5.6 and its InternVL export transformers <= 4.57.6; this
  project pins 5.25): LITEVLM_OPENVINO_VENV overrides it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

STRIPPED = ("OMP_", "KMP_", "MKL_", "GOMP_", "LITEVLM_")
HERE = Path(__file__).parent
REPO = HERE.parents[2]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(STRIPPED)}
    prefix = str(Path(sys.prefix).resolve())
    kept = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep)
            if p and not str(Path(p).resolve()).startswith(prefix)]
    if kept:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
    else:
        env.pop("LD_LIBRARY_PATH", None)
    env["_ROS_WHEELS_BOOTSTRAP_COMPLETE"] = "1"      # no re-exec with the ROS libraries' paths
    env["PYTHONNOUSERSITE"] = "1"
    env.pop("PYTHONPATH", None)
    return env


def llama_src() -> Path:
    return Path(sys.prefix) / "share" / "litevlm-peers" / "llama.cpp"


def openvino_python() -> Path:
    venv = os.environ.get("LITEVLM_OPENVINO_VENV") or str(REPO / ".venv-openvino")
    return Path(venv) / "bin" / "python"


def probe(python: Path | str, code: str) -> str | None:
    """None when `code` runs in `python` (a clean environment), else why not (its last line)."""
    if not Path(python).is_file():
        return f"{python} does not exist (bash scripts/setup.sh --peers)"
    proc = subprocess.run([str(python), "-c", code], env=clean_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def llama_cpp_missing() -> str | None:
    """Why the llama.cpp rows cannot run here (None: they can)."""
    why = probe(sys.executable, "import llama_cpp, llama_cpp.mtmd_cpp")
    if why:
        return f"llama-cpp-python with libmtmd: {why} (bash scripts/setup.sh --peers)"
    if not (llama_src() / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp's converter is not in {llama_src()} (bash scripts/setup.sh --peers)"
    return None


def openvino_missing() -> str | None:
    why = probe(openvino_python(), "import openvino_genai, optimum.intel")
    return f"OpenVINO GenAI / optimum-intel: {why} (bash scripts/setup.sh --peers)" if why else None


def run_script(python: Path | str, script: Path, args: list[str], log: Path) -> None:
    """A peer script in its own process, clean environment, stderr appended to `log`."""
    with open(log, "a") as err:
        err.write(f"\n$ {python} {script.name} {' '.join(args)}\n")
        err.flush()
        proc = subprocess.run([str(python), str(script), *args], env=clean_env(), stdout=err, stderr=err,
                              cwd=str(script.parent))
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{script.name} {' '.join(args[:2])} failed (exit {proc.returncode}); see {log}:\n{tail}")


def run_project(job: Path, out: Path, log: Path, what: str) -> None:
    """This project's row in its own process (`python -m litevlm_runtime.bench.peers.run_project JOB
    OUT`), in this process's environment (the project's own thread settings), output appended to
    `log`; `what` names the row in the error."""
    with open(log, "a") as err:
        rc = subprocess.run([sys.executable, "-m", "litevlm_runtime.bench.peers.run_project", str(job), str(out)],
                            stdout=err, stderr=err).returncode
    if rc:
        raise RuntimeError(f"{what} failed (exit {rc}); see {log}")


def openmp_runtime() -> str:
    """The OpenMP runtime this process has loaded (a path from /proc/self/maps), '' if none."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libgomp" in line or "libiomp" in line or "libomp" in line:
            return line.split()[-1]
    return ""
