"""The one weight quantizer of the project: group-wise INT4 (asymmetric, or symmetric as TensorRT /
ModelOpt INT4 AWQ computes it), round-to-nearest or AWQ-scaled, and per-channel INT8. The PyTorch
engines run these weights on the CPU kernels of lowbit_kernels.py (`backend.weights int4 |
int4-rtn | int8`); the ONNX export of TensorRT's INT4 AWQ graphs writes the same tensors as Q/DQ.
Nothing here knows about the pipeline: the activations AWQ needs come in as rows (export/awq.py
records them from the project's own traffic).

## The quantized-weight format (version FORMAT; what `litevlm quantize` stores)

A linear layer y = x @ W.T + b with W: [N, K] (N outputs, K inputs) becomes, at INT4:

    codes            uint8   [N, K // 2]   4-bit codes q in [0, 15], two per byte along K: element k of a
                                           row at byte k // 2, the low nibble for even k, the high for
                                           odd k (ONNX's uint4 packing: the first element in the 4 least
                                           significant bits)
    scales           float16 [N, K // G]   one per (row, group of G consecutive inputs)
    zeros            uint8   [N, K // G]   zero point z in [0, 15] per (row, group), one per byte
    pre_quant_scale  float32 [K]           optional (AWQ): the input is multiplied by it first
    group size G     int                   in the manifest (GROUP_SIZE = 128 unless stated)

    dequant(W)[n, k] = (q[n, k] - z[n, k // G]) * scales[n, k // G]
    y = (x * pre_quant_scale) @ dequant(W).T + b          (pre_quant_scale absent: ones)

so the float weight it stands for is dequant(W) * pre_quant_scale (column k scaled by
pre_quant_scale[k]). In ONNX: Mul(x, pre_quant_scale) -> MatMul with the weight
DequantizeLinear(codes as uint4 [N, K], scales [N, K/G], zeros as uint4 [N, K/G], axis=1,
block_size=G), transposed (or the same on the [K, N] transpose: axis=0, scales [K/G, N]).
Symmetric mode (what TensorRT / ModelOpt INT4 AWQ use: signed int4, block 128, no zero point)
is the same format with every zero = 8: code = clamp(round(w / s), -8, 7) + 8 with s = amax / 7,
so the signed int4 value is code - 8 (ONNX int4 with no zero point) and one kernel runs both.

Group size 128: what TensorRT-LLM / ModelOpt INT4 AWQ and the AWQ paper use (so the codes the
TensorRT export writes are these, one quantizer for both executors); it divides every width of
the models here (256 ... 8960), and its scale + zero cost 3 bytes per 128 weights (0.19 bits per
weight, 4.19 in all); a group of 32 (llama.cpp's Q4_0) would cost 4.75 bits per weight, 13% more
bytes per decode step. `--group-size` chooses another (a multiple of 64 dividing every K quantized).

Asymmetric (default): per group, the range [min(w, 0), max(w, 0)] (clipped by AWQ's clip ratio
when searched) in 15 steps, s = range / 15 rounded UP to float16 (so the range still fits),
z = round(-min / s); every weight inside the range is within s / 2 of its dequantized value.

At INT8: codes int8 [N, K] (symmetric, in [-127, 127]), scales float32 [N] (per output channel,
amax / 127); dequant(W)[n, k] = codes[n, k] * scales[n]; no zero point, no pre_quant_scale.

A tied LM head (InternVL3/3.5: logits = h @ E.T over the embedding E [V, D]) is quantized as the
linear layer with W = E; the embedding lookup reads the same codes (row `id` dequantized, times
pre_quant_scale), so one copy serves both.

Files: `<out>/quantized.safetensors` holds, per quantized module (its name in the model, e.g.
`language_model.model.layers.0.self_attn.q_proj`, a tied head under its embedding's name
`language_model.model.embed_tokens`), `<name>.codes`, `<name>.scales`, `<name>.zeros` (INT4) and
`<name>.pre_quant_scale` (AWQ); `<out>/quantization.json` is the manifest: FORMAT, the weights
kind (int4 | int4-rtn | int8), group size, symmetric, method, the source model's file digests, the
calibration it came from, per module its shape and searched AWQ exponent, and the sha256 of the
safetensors file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError, read_json
from .checkpoint import read_safetensors
from .integrity import sha256_file

FORMAT = "litevlm-lowbit/1"
GROUP_SIZE = 128
INT4_MAX = 15                  # codes 0..15
SYMMETRIC_ZERO = 8             # signed int4 [-8, 7] stored as code - 8
INT8_MAX = 127


# ------------------------------------------------------------------------------ nibble packing
def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (values 0..15, K even) -> [N, K // 2]: element k at byte k // 2, even k low."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] packed codes -> uint8 [N, K] (the inverse of pack_nibbles)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


# ------------------------------------------------------------------------------ INT4
@dataclass
class Int4Weight:
    """One linear layer's INT4 weight in the format above."""

    codes: torch.Tensor                       # uint8 [N, K // 2]
    scales: torch.Tensor                      # float16 [N, K // G]
    zeros: torch.Tensor                       # uint8 [N, K // G]
    group_size: int
    pre_quant_scale: torch.Tensor | None = None   # float32 [K]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    def nbytes(self) -> int:
        tensors = [self.codes, self.scales, self.zeros]
        if self.pre_quant_scale is not None:
            tensors.append(self.pre_quant_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.codes": self.codes, f"{prefix}.scales": self.scales, f"{prefix}.zeros": self.zeros}
        if self.pre_quant_scale is not None:
            out[f"{prefix}.pre_quant_scale"] = self.pre_quant_scale
        return out


def check_group(k: int, group_size: int, what: str = "weight") -> None:
    if group_size <= 0 or group_size % 64 or k % group_size:
        raise ValueError(f"{what}: {k} inputs are not a multiple of the INT4 group size {group_size} "
                         f"(a multiple of 64, the kernel's block, dividing every quantized width; --group-size)")


def float16_at_least(s: torch.Tensor) -> torch.Tensor:
    """s (float32, > 0) rounded up to float16 (the next float16 >= s, so a range still fits)."""
    h = s.clamp(min=2.0 ** -14, max=65504.0).to(torch.float16)
    low = h.float() < s
    h[low] = torch.nextafter(h[low], torch.tensor(math.inf, dtype=torch.float16))
    return h


def group_scales(w: torch.Tensor, group_size: int, symmetric: bool,
                 clip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales (float16) and zeros (uint8) [N, K // G] of w [N, K] float32; `clip` [N, K // G] or
    None: each group's range shrunk by that ratio (AWQ's clip search)."""
    n, k = w.shape
    g = w.view(n, k // group_size, group_size)
    if symmetric:
        amax = g.abs().amax(-1)
        if clip is not None:
            amax = amax * clip
        scales = float16_at_least(amax / 7.0)
        return scales, torch.full_like(scales, SYMMETRIC_ZERO, dtype=torch.uint8)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if clip is not None:
        lo, hi = lo * clip, hi * clip
    scales = float16_at_least((hi - lo) / INT4_MAX)
    zeros = torch.round(-lo / scales.float()).clamp(0, INT4_MAX).to(torch.uint8)
    return scales, zeros


CHUNK_ROWS = 8192      # rows quantized at a time: float temporaries of a 151k-row LM head stay ~50 MB, not GBs


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE, symmetric: bool = False,
                  pre_quant_scale: torch.Tensor | None = None, clip: torch.Tensor | None = None) -> Int4Weight:
    """weight [N, K] float -> Int4Weight, round to nearest. `pre_quant_scale` [K] (AWQ): the weight
    quantized is weight / pre_quant_scale (column-wise), the input multiplied by it at run time."""
    n, k = weight.shape
    check_group(k, group_size)
    codes = torch.empty(n, k // 2, dtype=torch.uint8)
    scales = torch.empty(n, k // group_size, dtype=torch.float16)
    zeros = torch.empty(n, k // group_size, dtype=torch.uint8)
    for r0 in range(0, n, CHUNK_ROWS):
        w = weight[r0:r0 + CHUNK_ROWS].detach().float()
        if pre_quant_scale is not None:
            w = w / pre_quant_scale.float()[None, :]
        sc, ze = group_scales(w, group_size, symmetric, None if clip is None else clip[r0:r0 + CHUNK_ROWS])
        s = sc.float().repeat_interleave(group_size, dim=1)
        z = ze.float().repeat_interleave(group_size, dim=1)
        codes[r0:r0 + CHUNK_ROWS] = pack_nibbles(torch.round(w / s + z).clamp_(0, INT4_MAX).to(torch.uint8))
        scales[r0:r0 + CHUNK_ROWS], zeros[r0:r0 + CHUNK_ROWS] = sc, ze
    pqs = None if pre_quant_scale is None else pre_quant_scale.detach().float().contiguous()
    return Int4Weight(codes, scales, zeros, group_size, pqs)


def dequantize_int4(qw: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequant(W) [N, K]: the matrix the quantized product multiplies (x * pre_quant_scale) by."""
    g = qw.group_size
    q = unpack_nibbles(qw.codes).to(dtype)
    s = qw.scales.to(dtype).repeat_interleave(g, dim=1)
    z = qw.zeros.to(dtype).repeat_interleave(g, dim=1)
    return (q - z) * s


def effective_weight(qw: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] the INT4 layer stands for: dequant(W) * pre_quant_scale."""
    w = dequantize_int4(qw, dtype)
    return w if qw.pre_quant_scale is None else w * qw.pre_quant_scale.to(dtype)[None, :]


# ------------------------------------------------------------------------------ INT8
@dataclass
class Int8Weight:
    codes: torch.Tensor       # int8 [N, K]
    scales: torch.Tensor      # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.codes": self.codes, f"{prefix}.scales": self.scales}


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """weight [N, K] float -> int8 [N, K] and scales [N] float32: w ~= int8 * scale, per output row
    (symmetric, round to nearest of max|w_row| / 127: ModelOpt's INT8 weight quantizer's definition)."""
    n, k = weight.shape
    codes, scales = torch.empty(n, k, dtype=torch.int8), torch.empty(n)
    for r0 in range(0, n, CHUNK_ROWS):
        w = weight[r0:r0 + CHUNK_ROWS].detach().float()
        s = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
        codes[r0:r0 + CHUNK_ROWS] = torch.round(w / s[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        scales[r0:r0 + CHUNK_ROWS] = s
    return Int8Weight(codes, scales)


def dequantize_int8(qw: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return qw.codes.to(dtype) * qw.scales.to(dtype)[:, None]


# ------------------------------------------------------------------------------ AWQ
def int4_output_error(x: torch.Tensor, ref: torch.Tensor, qw: Int4Weight) -> float:
    """Mean squared error of the INT4 layer's output on rows x [R, K] against the float layer's
    `ref` [R, N] (float32 products: their rounding, ~1e-7 relative, is far below the differences
    between the candidates the search compares)."""
    xs = x if qw.pre_quant_scale is None else x * qw.pre_quant_scale
    return float(((xs @ dequantize_int4(qw).T - ref).double() ** 2).mean())


@dataclass
class AwqResult:
    weight: Int4Weight
    alpha: float             # the exponent chosen (0: round to nearest, no scaling)
    error: float             # output MSE on the calibration rows at alpha
    rtn_error: float         # the same at alpha = 0 (round to nearest), for the record
    clip: float              # the range ratio chosen by the clip search (1.0: none)
    output_power: float      # mean square of the float layer's output on those rows

    @property
    def relative_error(self) -> float:
        """The output error relative to the output itself (what says a layer is sensitive to INT4)."""
        return self.error / max(self.output_power, 1e-30)


AWQ_GRID = 20                # exponents 0, 1/20, ..., 1 (the AWQ paper's grid)
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def awq_quantize(weight: torch.Tensor, x: torch.Tensor, group_size: int = GROUP_SIZE, symmetric: bool = False,
                 grid: int = AWQ_GRID, clip_grid=CLIP_GRID) -> AwqResult:
    """AWQ (Lin et al. 2024) for one linear layer: weight [N, K], x [R, K] its input rows recorded on
    calibration traffic. Salient input channels (large mean |x|) are protected by scaling their
    weight columns up before rounding and the input down by the same factor at run time:
    a = mean|x|^alpha (normalised to geometric mean 1), quantize(W * a), pre_quant_scale = 1 / a,
    alpha searched on the grid for the least output error on x (alpha 0 is round to nearest, so the
    result is never worse than RTN on these rows). Then, at the chosen scale, one clip ratio per
    layer (the group ranges shrunk by r in `clip_grid`, AWQ's asymmetric clipping search done per
    layer rather than per group: fewer choices fitted to the same rows) where it lowers the error.
    Per layer: its own output error, not the whole block's (AWQ's q/k/v and gate/up share one
    scale folded into the norm; here each layer multiplies its own input, so each gets its own)."""
    w = weight.detach().float()
    x = x.float()
    ref = x @ w.T
    mean_abs = x.abs().mean(0).clamp(min=1e-6)
    best: tuple[float, float, Int4Weight] | None = None
    rtn_error = math.inf
    for i in range(grid + 1):
        alpha = i / grid
        a = mean_abs ** alpha
        a = a / torch.sqrt(a.max() * a.min())
        qw = quantize_int4(w, group_size, symmetric, pre_quant_scale=None if i == 0 else 1.0 / a)
        err = int4_output_error(x, ref, qw)
        if i == 0:
            rtn_error = err
        if best is None or err < best[0]:
            best = (err, alpha, qw)
    err, alpha, qw = best
    clip = 1.0
    for r in clip_grid[1:]:
        n, k = w.shape
        ratio = torch.full((n, k // group_size), r)
        trial = quantize_int4(w, group_size, symmetric, pre_quant_scale=qw.pre_quant_scale, clip=ratio)
        e = int4_output_error(x, ref, trial)
        if e < err:
            err, clip, best_trial = e, r, trial
    if clip != 1.0:
        qw = best_trial
    return AwqResult(qw, alpha, err, rtn_error, clip, float((ref.double() ** 2).mean()))


# ------------------------------------------------------------------------------ files
SAFETENSORS_FILE = "quantized.safetensors"
MANIFEST_FILE = "quantization.json"
KINDS = ("int4", "int4-rtn", "int8")


def save_quantized(out, weights: dict[str, Int4Weight | Int8Weight], manifest: dict) -> dict:
    """Write `weights` (module name -> form) as <out>/quantized.safetensors and the manifest beside it
    (`manifest` gives kind, method, source, calibration...; FORMAT, modules and the file's sha256
    are added). Returns the manifest written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    modules = {}
    for name, qw in weights.items():
        tensors.update({k: v.detach().cpu().contiguous() for k, v in qw.tensors(name).items()})
        modules[name] = {"shape": list(qw.shape), "format": "int4" if isinstance(qw, Int4Weight) else "int8"}
        if isinstance(qw, Int4Weight):
            modules[name]["group_size"] = qw.group_size
    save_file(tensors, str(out / SAFETENSORS_FILE), metadata={"format": FORMAT})
    for name, extra in manifest.pop("module_info", {}).items():
        modules[name].update(extra)
    manifest = {"format": FORMAT, **manifest, "modules": modules,
                "files": {SAFETENSORS_FILE: {"sha256": sha256_file(out / SAFETENSORS_FILE)}}}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_quantized(folder) -> tuple[dict, dict[str, Int4Weight | Int8Weight]]:
    """(manifest, module name -> form) of a folder `save_quantized` wrote, its file checked against
    the manifest's sha256 and every module's tensors against the manifest's shapes."""
    folder = Path(folder)
    if not (folder / MANIFEST_FILE).is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST_FILE} (quantized weights are written by `litevlm quantize`)")
    manifest = read_json(folder / MANIFEST_FILE, "quantized-weights manifest")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{folder / MANIFEST_FILE}: format {manifest.get('format')!r}, "
                              f"this runtime reads {FORMAT!r}")
    path = folder / SAFETENSORS_FILE
    want = manifest.get("files", {}).get(SAFETENSORS_FILE, {}).get("sha256")
    if not path.is_file() or sha256_file(path) != want:
        raise CheckpointError(f"{path}: missing or not the file its manifest lists (sha256 mismatch)")
    tensors = read_safetensors(path)
    out: dict[str, Int4Weight | Int8Weight] = {}
    for name, info in manifest["modules"].items():
        try:
            if info["format"] == "int4":
                qw = Int4Weight(tensors[f"{name}.codes"], tensors[f"{name}.scales"], tensors[f"{name}.zeros"],
                                int(info["group_size"]), tensors.get(f"{name}.pre_quant_scale"))
                n, k = info["shape"]
                g = qw.group_size
                ok = (qw.codes.shape == (n, k // 2) and qw.codes.dtype == torch.uint8
                      and qw.scales.shape == (n, k // g) and qw.scales.dtype == torch.float16
                      and qw.zeros.shape == (n, k // g) and qw.zeros.dtype == torch.uint8
                      and (qw.pre_quant_scale is None or qw.pre_quant_scale.shape == (k,)))
            else:
                qw = Int8Weight(tensors[f"{name}.codes"], tensors[f"{name}.scales"])
                ok = list(qw.codes.shape) == info["shape"] and qw.codes.dtype == torch.int8
        except KeyError as exc:
            raise CheckpointError(f"{path}: module {name}: tensor {exc} missing") from None
        if not ok:
            raise CheckpointError(f"{path}: module {name}: tensors do not match the manifest's {info['format']} "
                                  f"shape {info['shape']}")
        out[name] = qw
    return manifest, out
