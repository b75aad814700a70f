"""Which float32 GEMM kernel a CPU linear layer runs (`backend.gemm`).

PyTorch's CPU wheels run a float32 `F.linear` through MKL's sgemm. MKL picks its code path by
CPU vendor, and on a non-Intel CPU it takes the AVX2 one even where the CPU has AVX-512: on an
AMD EPYC (Zen 5, AVX-512, 1 thread) it ran the bundled model's linears (64-512 rows, widths
256/768/1024) at 86-95 GFLOP/s, oneDNN's float32 matmul at 167-219 GFLOP/s on the same calls
(docs/performance.md). oneDNN dispatches by instruction set, not vendor. Both compute in float32
(IEEE, float32 accumulation), in different orders: their results differ by float reassociation,
within 1e-6 relative of a float64 recomputation each (tests/weights/test_gemm.py).

    torch    F.linear as torch dispatches it (MKL on x86 wheels)
    onednn   calls of >= ONEDNN_MIN_ROWS rows through oneDNN's matmul (torch.ops.mkldnn._linear_pointwise,
             the op inductor's own oneDNN passes emit; the weight stays the checkpoint's dense tensor,
             no second copy); smaller calls (a decode step) stay F.linear, where MKL's GEMV is faster
             (1 row at 256 x 768: 13 against 23 us)
    auto     onednn where MKL restricts itself (a non-Intel CPU with AVX-512), torch elsewhere: on an
             Intel CPU MKL already runs AVX-512 and no measurement here says oneDNN beats it

Written here rather than by a library flag because torch has none for it: its mkldnn matmul
switch (`torch.backends.mkldnn.matmul.fp32_precision`) only routes float32 through oneDNN when it
may round to bfloat16/tf32, which changes the numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpuinfo import read_cpuinfo
from ..models.decoder import in_graph

GEMM_KINDS = ("auto", "torch", "onednn")
ONEDNN_MIN_ROWS = 4     # rows from which oneDNN's float32 matmul beats MKL here (measured: 2 rows 0.9x, 5 rows 1.8x)


def mkl_limits_this_cpu(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True on a CPU with AVX-512 that is not Intel's, where MKL's sgemm runs its AVX2 path."""
    vendor, flags = read_cpuinfo(cpuinfo) or ("", [])
    return bool(vendor) and vendor != "GenuineIntel" and "avx512f" in flags


def resolve_gemm(kind: str, device: torch.device | str, dtype: torch.dtype, cpuinfo: str = "/proc/cpuinfo") -> str:
    """`torch` or `onednn` for `kind` on this device and dtype (oneDNN's float32 matmul is a CPU path)."""
    if kind not in GEMM_KINDS:
        raise ValueError(f"backend.gemm {kind!r}: one of {', '.join(GEMM_KINDS)}")
    if torch.device(device).type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return "torch"
    if kind == "auto":
        return "onednn" if mkl_limits_this_cpu(cpuinfo) else "torch"
    return kind


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) by oneDNN's float32 matmul, no post-op."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDnnLinear(nn.Linear):
    """nn.Linear whose float32 calls of >= ONEDNN_MIN_ROWS rows run oneDNN's matmul; x [..., K] -> [..., N].
    Same parameters, same state dict: every other reader (export, torch.compile, int8/bf16
    conversion) sees an nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Graphs (torch.compile, torch.export under the ONNX export) take the plain linear: inductor
        # lowers this op only for frozen weights, an exported graph must not name a torch-internal
        # op, and the row test below would guard a dynamic batch dimension into a constant (the
        # batched step's B in [2, 4] was exported as 4): so the graph test comes first.
        if in_graph():
            return F.linear(x, self.weight, self.bias)
        if x.dtype != torch.float32 or x.numel() < ONEDNN_MIN_ROWS * self.in_features or x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, self.weight, self.bias)


def use_onednn(roots) -> int:
    """Make every plain nn.Linear below `roots` (None skipped) an OneDnnLinear, in place, sharing
    its parameters; returns how many. Int8Linear/Bf16Linear are not nn.Linear: they keep their kernels."""
    count = 0
    for root in roots:
        if root is None:
            continue
        for module in root.modules():
            if type(module) is nn.Linear:
                module.__class__ = OneDnnLinear     # same attributes and parameters: only forward differs
                count += 1
    return count
