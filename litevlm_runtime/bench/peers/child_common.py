"""What every peer child reports about its own process, standard library only: the peer scripts
(run_llama_cpp.py, run_openvino.py) import it from their own folder, since they run by path in
interpreters that must not import litevlm_runtime (the OpenVINO one cannot: it is another venv)."""

from __future__ import annotations

import os
import sys

RUNTIME_LIBRARIES = ("libgomp", "libiomp", "libomp.so", "libtbb")


def peak_rss_gb() -> float:
    """This process's peak resident set (VmHWM: reset by exec, unlike ru_maxrss)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2 ** 20
    return 0.0


def environment_check() -> dict:
    """What this process inherited and loaded: proof that it runs apart from the project, with no
    OpenMP / MKL variables, and which threading runtime (OpenMP, TBB) it loaded."""
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    runtimes = sorted({line.split()[-1] for line in maps if any(lib in line for lib in RUNTIME_LIBRARIES)})
    return {"imports_litevlm": any(m == "litevlm_runtime" or m.startswith("litevlm_runtime.") for m in sys.modules),
            "thread_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "MKL_", "GOMP_"))},
            "openmp_runtime": runtimes}
