"""How the low-bit CPU kernels are built and what is said where they cannot run
(kernels/lowbit_kernels.py): by torch.utils.cpp_extension into a folder per source, once, also when
two processes build at once and a killed build left torch's lock file behind; linked with no OpenMP
runtime beside torch's; a CPU the kernels do not cover is named, and the weight forms say which
path they run (the node's /diagnostics shows it: tests/ros/test_node_backends.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_checkpoint, options

from litevlm_runtime.kernels import lowbit_kernels

# A source as small as one operator: the build machinery, not the kernels, is under test.
TINY = """#include <torch/library.h>
int64_t twice(int64_t x) { return 2 * x; }
TORCH_LIBRARY(litevlm_build_test, m) { m.def("twice(int x) -> int", &twice); }
"""
# /proc/cpuinfo of an aarch64 CPU (DRIVE Thor, Jetson): Features, no x86 flags.
AARCH64 = "processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd evtstrm aes\n"
BUILD = """import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(message)s")
from litevlm_runtime.kernels.lowbit_kernels import build
print(build(Path(sys.argv[1]), "litevlm_build_test", Path(sys.argv[2])))
"""


def test_two_processes_build_a_source_once_past_a_stale_torch_lock(tmp_path):
    source, cache = tmp_path / "tiny.cpp", tmp_path / "kernels"
    source.write_text(TINY)
    folder = lowbit_kernels.build_folder(source, "litevlm_build_test", cache)
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")        # torch's baton, as a killed build leaves it: waited on forever
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(source), str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    (lib,) = {Path(out.strip()) for out, _ in outs}
    assert lib.parent == folder and lib.is_file()
    assert sum("building the low-bit CPU kernels" in err for _, err in outs) == 1, outs
    torch.ops.load_library(str(lib))
    assert torch.ops.litevlm_build_test.twice(21) == 42

    assert lowbit_kernels.build(source, "litevlm_build_test", cache) == lib          # the stamp: no rebuild
    source.write_text(TINY + "// changed\n")
    assert lowbit_kernels.build_folder(source, "litevlm_build_test", cache) != folder   # a new source, a new build


@pytest.mark.skipif(not lowbit_kernels.load(), reason="low-bit CPU kernels not built here")
@pytest.mark.skipif(shutil.which("readelf") is None, reason="no readelf")
def test_the_kernels_link_no_openmp_runtime_of_their_own():
    """Compiled with -fopenmp for the pragmas, linked without it: the parallel regions run on the
    libgomp torch loaded, which torch.set_num_threads and OMP_WAIT_POLICY govern."""
    dynamic = subprocess.run(["readelf", "-d", str(lowbit_kernels.build())], capture_output=True, text=True,
                             check=True).stdout
    needed = [line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert "libc10.so" in needed and not [n for n in needed if "omp" in n], needed


@pytest.mark.parametrize("flags, missing", [
    ("", ["avx2", "fma", "f16c"]),                                    # aarch64 lists Features, no flags
    ("fpu sse2 ssse3 sse4_2 fma f16c", ["avx2"]),                      # x86-64 without AVX2
    ("fpu sse2 avx avx2 fma f16c bmi2", []),
])
def test_the_instruction_sets_a_cpu_lacks_are_named(tmp_path, flags, missing):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: Some\nflags\t\t: {flags}\n" if flags else AARCH64)
    assert lowbit_kernels.missing_flags(str(cpuinfo)) == missing
    assert lowbit_kernels.cpu_supports(str(cpuinfo)) == (not missing)


def test_the_forms_say_which_path_they_run(tmp_path):
    """In this process: the kernels where they loaded. In one whose CPU reads as an aarch64's (what
    the kernels do not cover): the log says so once, the weight forms (what /diagnostics shows) name
    the reference path and why, and answers still come."""
    from litevlm_runtime.pipeline.pipeline import Pipeline

    model = make_tiny_checkpoint(tmp_path / "tiny")
    forms = Pipeline.from_pretrained(model, options(backend__weights="int8")).rt.weights
    assert forms.kernels == ("kernels" if lowbit_kernels.load() else f"reference path: {lowbit_kernels.unavailable()}")
    assert Pipeline.from_pretrained(model, options(backend__weights="bf16")).rt.weights.kernels == ""

    (tmp_path / "cpuinfo").write_text(AARCH64)
    script = f"""import sys
sys.path.insert(0, "tests")
from helpers import options, random_frames
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.kernels import lowbit_kernels
lowbit_kernels.CPUINFO = {str(tmp_path / "cpuinfo")!r}
for weights in ("int4-rtn", "int8"):
    pipe = Pipeline.from_pretrained({str(model)!r}, options(backend__weights=weights, max_new_tokens=2))
    assert pipe.answer(random_frames(1), "What is ahead?").token_ids
print(pipe.rt.weights.kernels)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    lacks = "lacks avx2+fma+f16c: the low-bit kernels are x86-64 AVX2 code"
    assert run.stdout.strip().splitlines()[-1].startswith("reference path: this CPU (") and lacks in run.stdout
    assert run.stderr.count(lacks) == 1, run.stderr
