"""The CPU kernels of the low-bit weight forms (int4, int8, fp16): lowbit_kernels.cpp, built by torch's
own extension tooling (`torch.utils.cpp_extension.load`: ninja, torch's include and library paths,
its ABI and C++ standard) on first use, cached, and loaded as torch operators
(`torch.ops.litevlm_lowbit.*`, with fake implementations so torch.compile can trace them).

Why our own kernel: on the AVX2-only CPUs this project meets (AMD EPYC Zen 3: no AVX-512, no VNNI,
no bfloat16 units), torch 2.13's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` and
torchao's CPU layouts (which call them) were not faster than the float32 matmul on a decode step's
one row (docs/performance.md: the candidates table, `litevlm bench --study lowbit_kernels`); llama.cpp's
ggml kernels are what reach the memory floor there, and this is that scheme (int4 x int8 with
vpmaddubsw) for the project's format (quantize.py), on torch's own thread pool. Where the CPU has
AVX-512 VNNI (Zen 4, Ice Lake and later), the int4 decode loop uses vpdpbusd instead, chosen at run
time (`torch.ops.litevlm_lowbit.use_avx512(False)` turns it off: the tests run both loops).

Why built where it runs (`load`), not ahead of time in setup.py (a CppExtension): the flags are for
the CPU that runs it (AVX2/FMA/F16C, x86-64 only: on aarch64 the source does not compile, and an
install there must still succeed); an ahead-of-time build needs torch inside pip's isolated build
environment (a second torch download, possibly not the version it runs with) or
--no-build-isolation from every user and from colcon; and a failed build must leave a working
runtime (the reference path), not a failed install. So one path serves an editable install, a
`pip install .` or colcon install (the .cpp is package data: setup.py) and a fresh clone's
scripts/test.sh (scripts/setup.sh builds it once at set-up).

The build: lowbit_kernels.cpp, layer_ops.cpp (the decoder layer's small operators) and decode_layer.cpp
(a decode layer as one call of them; kernel_ops.h declares what it calls) into one library at -O3 -mavx2
-mfma -mf16c -fopenmp (about 20-40 s on two cores),
in ~/.cache/litevlm/kernels/lowbit-<digest of the sources, torch and Python version, flags>/
($LITEVLM_KERNEL_CACHE overrides): a build per source change, and two checkouts with different
sources never build over each other. Under a file lock: parallel test workers build once. (torch's
own lock is a file a killed build leaves behind, after which every build waits forever; under ours
no one else is building, so such a file is stale and removed.) A `built` stamp written after the
library loaded is what later processes look for: they load it without running ninja. Linked
without an OpenMP library of its own (compiled with -fopenmp for its pragmas; torch's link line adds
none): its parallel regions run on the libgomp torch already loaded, so `torch.set_num_threads` and
OMP_WAIT_POLICY=PASSIVE (threads.py) govern them too (tests/kernels/test_lowbit_build.py checks the library's
NEEDED entries).

Fallback: a CPU without AVX2/FMA/F16C (aarch64: DRIVE Thor, Jetson; old x86), no compiler, or a
failed build -> `available()` is False, a warning says why once, `path_in_words` says it for the
node's /diagnostics (lowbit_kernels), and the forms run their reference path (dequantize, then the
float matmul: the same numbers up to the activation rounding, several times slower at decode).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import math
import os
import platform
import sys
from pathlib import Path

import torch

from ..threads import available_cores
from .cpuinfo import read_cpuinfo

SOURCE = Path(__file__).with_name("lowbit_kernels.cpp")
# The library's sources: the weight kernels and attention, the decoder layer's small operators, and a
# decode layer as one call.
SOURCES = (SOURCE, Path(__file__).with_name("layer_ops.cpp"), Path(__file__).with_name("decode_layer.cpp"))
HEADERS = tuple(Path(__file__).with_name(h) for h in ("simd_avx2.h", "kernel_ops.h"))   # (in the build's digest)
NAME = "litevlm_lowbit"                # the library's name (its operators' namespace is the source's TORCH_LIBRARY)
REQUIRED_FLAGS = ("avx2", "fma", "f16c")
# Beside torch's own (-fPIC, its C++ standard, ABI and include paths): the CPU's instruction sets and
# the OpenMP pragmas (compile only: see the module docstring).
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG")
CACHE_ENV = "LITEVLM_KERNEL_CACHE"     # where builds are kept (default ~/.cache/litevlm/kernels)
# Set to 1 to run the reference path (tests compare both; also a way out should the build misbehave).
DISABLE_ENV = "LITEVLM_LOWBIT_KERNELS_OFF"
CPUINFO = "/proc/cpuinfo"              # what the CPU's instruction sets are read from
BUILT = "built"                        # the stamp of a complete build: the library's file name
REFERENCE_PATH = "the int4/int8/fp16 weight forms run their reference path (dequantize + float matmul, slower)"

log = logging.getLogger("litevlm.weights")


def missing_flags(cpuinfo: str | None = None) -> list[str]:
    """The instruction sets the kernels need that this CPU lacks (all of them on aarch64)."""
    info = read_cpuinfo(cpuinfo or CPUINFO)
    return [f for f in REQUIRED_FLAGS if info is None or f not in info[1]]


def cpu_supports(cpuinfo: str | None = None) -> bool:
    return not missing_flags(cpuinfo)


def kernel_cache() -> Path:
    """Builds live apart from the digest cache ($LITEVLM_CACHE, which tests point at a fresh folder
    per session): a build is keyed by its inputs, so one per machine serves every session."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "litevlm" / "kernels"


def build_folder(sources: Path | tuple[Path, ...] = SOURCES, name: str = NAME, folder: Path | None = None) -> Path:
    """Where `sources` are built: a folder per source text, torch and Python version and flags."""
    sources = (sources,) if isinstance(sources, Path) else sources
    inputs = [*(s.read_bytes() for s in (*sources, *HEADERS)), torch.__version__.encode(),
              sys.version.split()[0].encode(),
              platform.machine().encode(), " ".join(CFLAGS).encode()]
    digest = hashlib.sha256(b"\0".join(inputs)).hexdigest()[:16]
    return Path(folder or kernel_cache()) / f"{name.removeprefix('litevlm_')}-{digest}"


def build(sources: Path | tuple[Path, ...] = SOURCES, name: str = NAME, folder: Path | None = None) -> Path:
    """The shared library of `sources` (by torch.utils.cpp_extension): built once, then reused."""
    sources = (sources,) if isinstance(sources, Path) else sources
    where = build_folder(sources, name, folder)
    stamp = where / BUILT
    if stamp.is_file():
        return where / stamp.read_text().strip()
    where.mkdir(parents=True, exist_ok=True)
    with open(where / ".flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # released by the kernel if this process dies
        if stamp.is_file():                   # another process built it while we waited
            return where / stamp.read_text().strip()
        (where / "lock").unlink(missing_ok=True)      # torch's baton, left by a build that was killed
        log.info("building the low-bit CPU kernels (once, about half a minute): %s", where)
        # (imported only to build: it loads setuptools, a quarter of a second no served query needs)
        from torch.utils import cpp_extension  # noqa: PLC0415

        lib = Path(cpp_extension.load(name, [str(s) for s in sources], extra_cflags=list(CFLAGS),
                                      build_directory=str(where),
                                      is_python_module=False, verbose=False))
        stamp.write_text(lib.name + "\n")
    return lib


@functools.cache
def unavailable() -> str:
    """Why the kernels cannot run here, "" where they do: built (if needed) and loaded on the first
    call; where they cannot, a warning says why, once."""
    if os.environ.get(DISABLE_ENV):
        return f"{DISABLE_ENV} is set"
    missing = missing_flags()
    if missing:
        why = (f"this CPU ({platform.machine()}) lacks {'+'.join(missing)}: the low-bit kernels are x86-64 "
               f"AVX2 code")
        log.warning("%s; %s", why, REFERENCE_PATH)
        return why
    try:
        torch.ops.load_library(str(build()))
    except Exception as exc:      # any build or load failure: the reference path still answers correctly
        why = f"the low-bit kernels did not build or load ({str(exc).strip().splitlines()[0]})"
        log.warning("%s; %s", why, REFERENCE_PATH)
        return why
    _register_fakes()
    # the helpers' spin policy compares the machine's runnable threads with the CPUs this process may use
    torch.ops.litevlm_lowbit.set_cpus_available(available_cores())
    return ""


def load() -> bool:
    """Build (if needed) and load the kernels; False, with one warning, where they cannot run."""
    return not unavailable()


def path_in_words(on_kernels: bool) -> str:
    """Which path low-bit forms run, for a person (the node's /diagnostics: lowbit_kernels):
    "kernels", or "reference path: <why>"."""
    if on_kernels:
        return "kernels"
    return f"reference path: {unavailable() or 'not on the CPU'}"


def has_int8_gemm() -> bool:
    """Whether the kernels run the int8 prefill GEMM here (built and loaded: its AVX-512 VNNI micro-tiles
    where the CPU has them, else its AVX2 ones, which every CPU the kernels load on has)."""
    return load()


def has_vnni() -> bool:
    """Whether the CPU has AVX-512 VNNI and the kernels take it (the int4 decode loop, the GEMM's tiles)."""
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


def takes_rows_attention(q: torch.Tensor) -> bool:
    """Whether attention_rows runs this call's q [T, Hq, D] here: float32 on the CPU, D a multiple of 16,
    kernels loaded."""
    return q.shape[-1] % 16 == 0 and available(q)


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A few rows' attention over a cache that holds them (lowbit_kernels.cpp): softmax(q k^T / sqrt(D)) v
    in float32, q [T, Hq, D], k, v [Hkv, S, D] (unit stride over D), allowed [T, S] -> [T, Hq*D]; query
    head h reads KV head h // (Hq / Hkv). Needs takes_rows_attention(q)."""
    return torch.ops.litevlm_lowbit.attention_rows(q, k, v, allowed, 1.0 / math.sqrt(q.shape[-1]))


def takes_layer_ops(x: torch.Tensor) -> bool:
    """Whether layer_ops.cpp's operators (rms_norm, rope_, silu_mul) run this eager call on x: float32 on
    the CPU, kernels loaded, gradients off (the runtime's inference mode: the ops have no backward and
    rope_ writes in place, so training keeps torch's operators). A graph (export, torch.compile) never
    asks: models/decoder.py checks that first."""
    return not torch.is_grad_enabled() and available(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension of float32 x [..., D] (layer_ops.cpp)."""
    return torch.ops.litevlm_lowbit.rms_norm(x, weight, eps)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [T, Hq, D], k [T, Hkv, D] <- models/rope.apply_rope of each, in place, bit-identical (layer_ops.cpp);
    cos, sin [T, 1, D] from RotaryTable."""
    torch.ops.litevlm_lowbit.rope_(q, k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up [T, F] float32 with unit stride over F (layer_ops.cpp)."""
    return torch.ops.litevlm_lowbit.silu_mul(gate, up)


def decode_layer(x: torch.Tensor, tensors: list, ints: list[int], eps: float,  # noqa: PLR0913 - the operator's
                 k_cache: torch.Tensor, v_cache: torch.Tensor, allowed: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """A decoder layer's few rows x [T, D] over this layer's float cache k_cache, v_cache [Hkv, S, D] whose last T
    rows are theirs (written here), under allowed [T, S], as one call (decode_layer.cpp; tensors and ints from
    models/decoder.DecoderLayer.step_args) -> x [T, D] after the layer."""
    return torch.ops.litevlm_lowbit.decode_layer(x, tensors, ints, eps, k_cache, v_cache, allowed, cos, sin)


def available(x: torch.Tensor) -> bool:
    """Whether the kernels run this call: float32 on the CPU, kernels loaded."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load()


def _register_fakes() -> None:
    """Shapes for torch.compile / FakeTensor tracing: every linear maps x [M, K] to [M, N]."""
    ops = torch.ops.litevlm_lowbit

    # (each fake's parameters are its operator's schema, TORCH_LIBRARY in lowbit_kernels.cpp)
    @torch.library.register_fake("litevlm_lowbit::int4_linear")
    def _(x, codes, scales, zeros, pqs, group_size, gemv_max_rows, tile_bytes,  # noqa: PLR0913
          prefill_bf16=False, prefill_int8=False, tiles8=False):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("litevlm_lowbit::int8_linear")
    def _(x, codes, scales, gemv_max_rows, tile_bytes, prefill_bf16=False, prefill_int8=False):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("litevlm_lowbit::fp16_linear")
    def _(x, weight, gemv_max_rows, tile_bytes, prefill_bf16=False):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("litevlm_lowbit::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("litevlm_lowbit::silu_mul")
    def _(gate, up):
        return gate.new_empty(gate.shape)

    @torch.library.register_fake("litevlm_lowbit::attention_rows")
    def _(q, k, v, allowed, scale):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    del ops
