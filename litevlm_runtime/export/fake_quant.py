"""Fake quantization in PyTorch with the placement and rounding of a Q/DQ graph.

`FakeQuantLinear` wraps an nn.Linear as TensorRT's low-precision GEMMs compute it from a
ModelOpt Q/DQ graph: the activation rounded to FP8 (E4M3, per-tensor scale) before the product,
the weight rounded to FP8 (per-tensor scale) or to blocked INT4 (weight only, per block of
`block` input channels, symmetric, ModelOpt's `s = amax / 7`), the product then in the float
dtype. The rounding is torch's own float8_e4m3fn conversion (round to nearest even) after clamping
to +-448 (QuantizeLinear saturates), of x / scale computed in float32: what ONNX Runtime's
QuantizeLinear does (export/qdq.py recomputes the same with ml_dtypes). `fp8_scales` reads the
scales ModelOpt wrote into a graph, so that torch and ONNX Runtime round with the very same
numbers; tests/export/test_quant_fp8.py checks them equal on the graphs both run.

Why hand-written rather than ModelOpt's torch quantizers (modelopt.torch.quantization): those
calibrate their own scales and insert their own quantizer modules; here the scales must be the
ones already in the ONNX graph, and the wrapper must be removable layer by layer for the
sensitivity sweep (sensitivity.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LiteVLMError

# onnx is imported where FP8 scales are read from a bundle's graphs: the fake quantization itself is plain
# torch, and sensitivity runs it without onnx.

FP8_MAX = 448.0


def fp8_round(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """QuantizeLinear + DequantizeLinear to float8 e4m3fn: x [*] with a scale broadcast to it (per
    tensor, or a weight's per output channel as [N, 1])."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    q = (x.float() / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).to(x.dtype)


def int4_round(w: torch.Tensor, block: int) -> torch.Tensor:
    """Blocked symmetric INT4 of a Linear weight w [out, in]: per output row, per `block` input
    channels, s = amax / 7, codes round-half-even(w / s) clipped to [-8, 7] (ModelOpt's
    find_scales/rtn with use_zero_point=False, which TensorRT 10 consumes as DequantizeLinear
    with block_size)."""
    out, k = w.shape
    if k % block:
        raise ValueError(f"INT4 block {block} does not divide the {k} input channels")
    blocks = w.float().view(out, k // block, block)
    s = (blocks.abs().amax(-1, keepdim=True) / 7.0).clamp_(min=1e-12)
    return (torch.round(blocks / s).clamp_(-8, 7) * s).view(out, k).to(w.dtype)


class FakeQuantLinear(nn.Module):
    """y = x~ @ W~^T + b, with x~ the activation rounded to FP8 (when `act_scale` is given) and W~
    the weight rounded once, here (FP8 with `weight_scale`, or INT4 in blocks of `int4_block`)."""

    def __init__(self, linear: nn.Linear, act_scale: float | None = None, weight_scale: float | None = None,
                 int4_block: int = 0):
        super().__init__()
        self.inner = linear
        self.act_scale = act_scale
        w = linear.weight.detach()
        if int4_block:
            w = int4_round(w, int4_block)
        elif weight_scale is not None:
            w = fp8_round(w, weight_scale)
        self.register_buffer("weight", w, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_scale is not None:
            x = fp8_round(x, self.act_scale)
        return F.linear(x, self.weight, self.bias)


@contextmanager
def swapped(root: nn.Module, replacements: dict[str, nn.Module]):
    """Modules of `root` replaced by name (dotted paths) for the duration of the block."""
    originals = {}
    try:
        for name, module in replacements.items():
            parent_name, _, child = name.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            originals[name] = getattr(parent, child)
            setattr(parent, child, module)
        yield root
    finally:
        for name, module in originals.items():
            parent_name, _, child = name.rpartition(".")
            setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def _origin(graph) -> dict[str, str]:
    """Graph value -> the initializer it is (through Transpose/Cast/Identity/Reshape)."""
    origin = {t.name: t.name for t in graph.initializer}
    for n in graph.node:
        if n.op_type in ("Transpose", "Cast", "Identity", "Reshape") and n.input and n.input[0] in origin:
            origin.update({o: origin[n.input[0]] for o in n.output})
    return origin


def fp8_scales(path: Path) -> dict[str, tuple[float, float | torch.Tensor]]:
    """Per quantized weight product of an FP8 Q/DQ graph: the weight's parameter name (the graph's
    initializer name: `model.` / `lm.` + the module path, as the stage modules are exported) ->
    (activation scale, weight scale: a float, or [N, 1] per output channel)."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path), load_external_data=False).graph
    values = {t.name: t for t in graph.initializer}
    made_by = {o: n for n in graph.node for o in n.output}
    origin = _origin(graph)
    found = {}

    def scale(q, weight: bool = False):
        value = numpy_helper.to_array(values[q.input[1]]).astype("float32")
        if value.size == 1:
            return float(value.reshape(()))
        if not weight:
            raise LiteVLMError(f"{path.name}: activation scale of {q.name} is not per tensor")
        # per output channel: axis 0 of the [N, K] weight itself, axis 1 of its transpose
        axis = next((int(a.i) for a in q.attribute if a.name == "axis"), 1)
        direct = q.input[0] in values
        if (axis if direct else 1 - axis) != 0:
            raise LiteVLMError(f"{path.name}: weight scale of {q.name} is not per output channel")
        return torch.from_numpy(value).reshape(-1, 1)

    for n in graph.node:
        if n.op_type not in ("MatMul", "Gemm"):
            continue
        qs = []
        for i in n.input[:2]:
            dq = made_by.get(i)
            q = made_by.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
            qs.append(q if q is not None and q.op_type == "QuantizeLinear" else None)
        if any(q is None for q in qs):
            continue
        weights = [q for q in qs if q.input[0] in origin]
        acts = [q for q in qs if q.input[0] not in origin]
        if len(weights) == 1 and len(acts) == 1:
            found[origin[weights[0].input[0]]] = (scale(acts[0]), scale(weights[0], weight=True))
    return found


def fp8_linears(root: nn.Module, scales: dict[str, tuple[float, float]], prefix: str,
                only: set[str] | None = None) -> dict[str, nn.Module]:
    """FakeQuantLinear replacements for the Linears of `root` named in `scales` (graph names:
    `prefix` + module path + `.weight`); `only`: just these module paths."""
    out = {}
    for name, (act, weight) in scales.items():
        if not name.startswith(prefix) or not name.endswith(".weight"):
            continue
        path = name[len(prefix):-len(".weight")]
        if only is not None and path not in only:
            continue
        module = root.get_submodule(path)
        if isinstance(module, nn.Linear):
            out[path] = FakeQuantLinear(module, act, weight)
    return out
