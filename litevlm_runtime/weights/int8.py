"""Int8 weight-only decoding (`backend.weights: int8`): the decoder's linear layers (every layer's
projections and the LM head) hold int8 weights with one float scale per output channel,
quantized at load from the float checkpoint of any model folder, and dequantized inside the
matmul by `torch._weight_int8pack_mm` (y = (x @ w_int8.T) * scale, accumulated in float32).

Why: a decode step reads every decoder weight once per token; at 2B shapes that is ~6.8 GB of
float32 per step, so the step is bound by memory bandwidth (`litevlm bench --roofline`), and int8
moves a quarter of the bytes. Only the weights change: norms, RoPE, attention and the KV cache
stay in the pipeline's dtype. The vision encoder and the EAGLE-2 draft layer stay float.

Numerics (docs/performance.md): symmetric per-channel rounding of w to 127 levels of
max|w_row|. Calls of at most FUSED_MAX_ROWS rows (decode steps, small trees: memory-bound) run
the int8 kernel; for a float32 pipeline on the CPU its activation, scales and output are
bfloat16 (torch 2.13's CPU int8pack kernel is vectorised only for bfloat16: measured 8x faster
than its float32 path and 16x than float16 at 2048 x 8192), accumulating in float32, so a
decode step's matmul outputs carry bfloat16 rounding (2^-9 relative) on top of the weights'.
Larger calls (prefill, vision-sized row counts: compute-bound, where that kernel is 2.6x slower
than the float GEMM) dequantize the weights into the pipeline's dtype and run the float GEMM:
exact float activations over the same int8 weights. On a GPU or other device the same
weights are always dequantized into a float matmul (correct, not faster).

TensorRT/ONNX Runtime: not this path. Their INT8/FP8 engines come from `litevlm calibrate`
(ModelOpt Q/DQ on the same weight matmuls, per-channel weight scales plus calibrated
activation scales); `backend.weights int8` with those backends is refused with that pointer.
"""

from __future__ import annotations

import torch
from torch import nn

FUSED_MAX_ROWS = 16     # rows up to which the int8 kernel beats dequantize + float GEMM (measured: 8 rows 2.2x, 64 rows 0.67x)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [N, K], scales [N] float32): w ~= int8 * scale, per output row."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class Int8Linear(nn.Module):
    """nn.Linear with int8 weights [N, K] and per-channel scales [N]; x [..., K] -> [..., N]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scales = quantize_per_channel(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dtype, device = linear.weight.dtype, linear.weight.device
        self.fused = device.type == "cpu"           # torch's int8pack kernel; elsewhere a dequantized matmul
        # The activation dtype the kernel runs at: its vectorised path is bfloat16/float16 (see above).
        self.act_dtype = torch.bfloat16 if dtype == torch.float32 and self.fused else dtype
        self.register_buffer("weight_int8", q.to(device))
        self.register_buffer("scales", scales.to(device, dtype))                   # [N], dequantized path
        self.register_buffer("kernel_scales", scales.to(device, self.act_dtype))   # [N], the int8 kernel's
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.fused and rows.shape[0] <= FUSED_MAX_ROWS:
            y = torch._weight_int8pack_mm(rows.to(self.act_dtype), self.weight_int8, self.kernel_scales).to(x.dtype)
        else:
            y = rows @ (self.weight_int8.to(x.dtype) * self.scales[:, None]).T
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"
