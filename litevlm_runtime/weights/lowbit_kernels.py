"""The CPU kernels of the low-bit weight forms (int4, int8, fp16): lowbit_kernels.cpp, built on first
use with the image's g++ against the installed torch, cached, and loaded as torch operators
(`torch.ops.litevlm_lowbit.*`, with fake implementations so torch.compile can trace them).

Why our own kernel: on the AVX2-only CPUs this project meets (AMD EPYC Zen 3: no AVX-512, no VNNI,
no bfloat16 units), torch 2.13's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` and
torchao's CPU layouts (which call them) were not faster than the float32 matmul on a decode step's
one row (docs/performance.md: the candidates table, `scripts/lowbit_kernels.py`); llama.cpp's
ggml kernels are what reach the memory floor there, and this is that scheme (int4 x int8 with
vpmaddubsw) for the project's format (quantize.py), on torch's own thread pool. Where the CPU has
AVX-512 VNNI (Zen 4, Ice Lake and later), the int4 decode loop uses vpdpbusd instead, chosen at run
time (`torch.ops.litevlm_lowbit.use_avx512(False)` turns it off: the tests run both loops).

The build: one translation unit, `g++ -O3 -mavx2 -mfma -mf16c -fopenmp` (about 20-40 s on two
cores), into ~/.cache/litevlm/kernels/lowbit-<digest of the source, torch version and flags>/
($LITEVLM_KERNEL_CACHE overrides; scripts/setup.sh builds it at set-up), under a file
lock (parallel test workers build once) and renamed into place when complete. Linked without an
OpenMP library of its own: its parallel regions run on the libgomp torch already loaded, so
`torch.set_num_threads` and OMP_WAIT_POLICY=PASSIVE (threads.py) govern them too.

Fallback: a CPU without AVX2/FMA/F16C, no compiler, or a failed build -> `available()` is False, a
warning says why once, and the forms run their reference path (dequantize, then the float
matmul: the same numbers up to the activation rounding, several times slower at decode).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch

from .cpuinfo import read_cpuinfo

SOURCE = Path(__file__).with_name("lowbit_kernels.cpp")
REQUIRED_FLAGS = ("avx2", "fma", "f16c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-std=c++17", "-DNDEBUG")
CACHE_ENV = "LITEVLM_KERNEL_CACHE"     # where builds are kept (default ~/.cache/litevlm/kernels)
# Set to 1 to run the reference path (tests compare both; also a way out should the build misbehave).
DISABLE_ENV = "LITEVLM_LOWBIT_KERNELS_OFF"

log = logging.getLogger("litevlm.weights")


def cpu_supports(cpuinfo: str = "/proc/cpuinfo") -> bool:
    info = read_cpuinfo(cpuinfo)
    return info is not None and all(f in info[1] for f in REQUIRED_FLAGS)


def _build_flags() -> tuple[list[str], list[str]]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = [*CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
                     f"-I{sysconfig.get_paths()['include']}"]
    link_flags = ["-shared", *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu",
                  *(f"-Wl,-rpath,{p}" for p in library_paths())]
    return compile_flags, link_flags


def kernel_cache() -> Path:
    """Builds live apart from the digest cache ($LITEVLM_CACHE, which tests point at a fresh folder
    per session): a build is keyed by its inputs, so one per machine serves every session."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "litevlm" / "kernels"


def build(folder: Path | None = None) -> Path:
    """The shared library for this source, torch and flag set: built once, then reused."""
    compile_flags, link_flags = _build_flags()
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()
                            + " ".join(compile_flags + link_flags).encode()).hexdigest()[:16]
    folder = Path(folder or kernel_cache()) / f"lowbit-{digest}"
    lib = folder / "litevlm_lowbit.so"
    if lib.is_file():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx}) on PATH")
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file():                        # another process built it while we waited
            return lib
        log.info("building the low-bit CPU kernels (once, about half a minute): %s", folder)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            obj, out = Path(tmp) / "k.o", Path(tmp) / "k.so"
            for cmd in ([cxx, *compile_flags, "-c", str(SOURCE), "-o", str(obj)],
                        [cxx, str(obj), "-o", str(out), *link_flags]):
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{done.stderr[-3000:]}")
            os.replace(out, lib)
    return lib


@functools.cache
def load() -> bool:
    """Build (if needed) and load the kernels; False, with one warning, where they cannot run."""
    if os.environ.get(DISABLE_ENV):
        return False
    if not cpu_supports():
        log.warning("low-bit CPU kernels need %s (not all in /proc/cpuinfo): the int4/int8/fp16 weight forms "
                    "run their reference path (dequantize + float matmul, slower)", "+".join(REQUIRED_FLAGS))
        return False
    try:
        torch.ops.load_library(str(build()))
    except Exception as exc:      # any build or load failure: the reference path still answers correctly
        log.warning("low-bit CPU kernels unavailable (%s); the int4/int8/fp16 weight forms run their reference "
                    "path (dequantize + float matmul, slower)", str(exc).splitlines()[0])
        return False
    _register_fakes()
    return True


def has_vnni() -> bool:
    """Whether the kernels run the int8 prefill GEMM here (built, loaded, and the CPU has AVX-512 VNNI)."""
    return load() and bool(torch.ops.litevlm_lowbit.has_avx512_vnni())


def has_bf16_attention() -> bool:
    """Whether the kernels run attention_bf16 here (built, loaded, and the CPU has AVX-512 BF16)."""
    return load() and bool(torch.ops.litevlm_lowbit.has_avx512_bf16())


def takes_attention(head_size: int) -> bool:
    """Whether attention_bf16 runs heads of this size here (a multiple of 64 up to 256: InternViT's 64 and
    the 2B decoders' 128; the small models' 32 stay on SDPA)."""
    return head_size % 64 == 0 and head_size <= 256 and has_bf16_attention()


def attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int = -1) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v with bfloat16 products and float32 sums (lowbit_kernels.cpp): q [B, Hq, N,
    D], k, v [B, Hkv, S, D] float32 (any strides; query head h reads KV head h // (Hq / Hkv)) -> [B, Hq, N, D].
    causal_offset < 0: no mask; else query i sees keys j <= i + causal_offset (a prompt after that many
    cached columns, all visible). Needs has_bf16_attention()."""
    return torch.ops.litevlm_lowbit.attention_bf16(q, k, v, 1.0 / math.sqrt(q.shape[-1]), causal_offset)


def available(x: torch.Tensor) -> bool:
    """Whether the kernels run this call: float32 on the CPU, kernels loaded."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load()


def _register_fakes() -> None:
    """Shapes for torch.compile / FakeTensor tracing: every op maps x [M, K] to [M, N]."""
    ops = torch.ops.litevlm_lowbit

    @torch.library.register_fake("litevlm_lowbit::int4_linear")
    def _(x, codes, scales, zeros, pqs, group_size, gemv_max_rows, tile_bytes, prefill_bf16=False, prefill_int8=False):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("litevlm_lowbit::int8_linear")
    def _(x, codes, scales, gemv_max_rows, tile_bytes, prefill_bf16=False, prefill_int8=False):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("litevlm_lowbit::fp16_linear")
    def _(x, weight, gemv_max_rows, tile_bytes, prefill_bf16=False):
        return x.new_empty(x.shape[0], weight.shape[0])

    del ops
