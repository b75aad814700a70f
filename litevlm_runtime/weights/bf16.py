"""bfloat16 matmuls for the compute-bound calls of a float32 pipeline (`backend.weights: bf16`).

Vision, prefill, token selection and the EAGLE-2 draft's catch-up push hundreds of rows through
each weight: they are compute-bound, and on a CPU with bfloat16 matrix units (AMX, AVX512-BF16)
oneDNN runs a bfloat16 GEMM several times faster than the float32 one (measured at 400 rows:
3.9x at InternVL2.5-2B's 2048 x 8192, 1.9x at the bundled model's 256 x 512;
docs/performance.md). Each linear layer keeps its float weight and gains a bfloat16 copy; a call
of at least BF16_MIN_ROWS rows rounds its input to bfloat16 and runs the bfloat16 GEMM
(products exact, float32 accumulation, the output rounded to bfloat16 once and handed back in
float32); a smaller call (a decode step, a small tree: memory-bound, where oneDNN's bfloat16
path is slower than the float32 GEMV) runs the float weight unchanged. Norms, softmax, RoPE,
residuals and the KV cache stay float32.

Numerics: the input's rounding (2^-9 relative) and the output's; a checkpoint stored in bfloat16
(the bundled model, InternVL2.5's own release) loses nothing in its weights. Answers agree with
float32's on most questions, not all: docs/performance.md has the agreement and accuracy on a
fresh SynthDrive seed. Costs memory: the bfloat16 copy is half the float weights again.

Where it applies: float32 pipelines on the CPU with the PyTorch engines (torch, torch-compile).
A bfloat16/float16 pipeline already runs these GEMMs in half precision, a GPU has its own (the
engines' dtype, TensorRT FP16/FP8), and ONNX Runtime/TensorRT run the bundle's graphs (refused
in options.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpuinfo import read_cpuinfo

BF16_UNIT_FLAGS = ("avx512_bf16", "amx_bf16")   # /proc/cpuinfo flags of CPUs that multiply bfloat16 natively


def cpu_has_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU multiplies bfloat16 in hardware (None: cannot tell, not Linux). Without
    those units oneDNN converts and runs its float32 kernels: measured on an AMD EPYC (AVX2), the
    bundled model's vision stage took 139.7 ms against float32's 21.2 ms. Read from /proc/cpuinfo
    because torch exposes no query for it (cpuinfo.py)."""
    info = read_cpuinfo(cpuinfo)
    return None if info is None else any(flag in info[1] for flag in BF16_UNIT_FLAGS)


# Largest float32 weight a small call widens from its bfloat16 copy (measured one row, 1 thread,
# AMD EPYC Zen 5: 0.8 MiB 1.25x, 4 MiB 1.34x faster than the float weight; 16 MiB 0.13x, 64 MiB
# 0.08x: a widened InternVL2.5-2B weight is a fresh buffer of 16-64 MB each call).
WIDEN_MAX_BYTES = 4 << 20
BF16_MIN_ROWS = (
    32  # rows from which the bfloat16 GEMM wins at the bundled model's widths (measured: 16 rows 0.96x, 32 1.3x)
)


class Bf16Linear(nn.Module):
    """nn.Linear that runs calls of >= BF16_MIN_ROWS rows as a bfloat16 GEMM; x [..., K] -> [..., N]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight                  # the float weight, shared with the float module
        self.bias = linear.bias
        self.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16))
        # A checkpoint stored in bfloat16 (InternVL2.5's release, the bundled model) has float
        # weights that are bfloat16 values: a small call then reads the copy, half the bytes, and
        # widens it to the same float32 weight (a decode step is bound by the bytes it reads), as
        # long as the widened weight stays in the core's cache for the GEMV that reads it.
        self.widen = (linear.weight.numel() * 4 <= WIDEN_MAX_BYTES
                      and bool(torch.equal(self.weight_bf16.float(), linear.weight.detach().float())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        if x.numel() < BF16_MIN_ROWS * self.in_features:
            return F.linear(x, self.weight_bf16.float() if self.widen else self.weight, self.bias)
        y = F.linear(x.to(torch.bfloat16), self.weight_bf16).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 GEMM from {BF16_MIN_ROWS} rows"
