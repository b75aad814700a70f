"""Low-bit weight forms of the decoder's linear layers (`backend.weights int4 | int4-rtn | int8 |
fp16`): every layer's projections, the LM head, and a tied head's embedding (InternVL3/3.5), in the
formats of quantize.py, multiplied by the CPU kernels of lowbit_kernels.cpp.

Why: a decode step reads every decoder weight once per token, so at 2B shapes it is bound by memory
bandwidth (`litevlm bench --roofline`): float32 moves ~6.2 GB per token at InternVL3-2B, fp16 half
of it, int8 a quarter, int4 (group 128) 0.13. Only the weights change: norms, RoPE, attention and
the KV cache stay in the pipeline's dtype; the EAGLE-2 draft layer stays float, and the vision
encoder's GEMMs follow `backend.vision_gemm` (linear_forms.py: this file's Int8Linear where it is int8,
auto beside these forms on a CPU with AVX-512 VNNI).

How a call runs (float32 activations on a CPU with AVX2/FMA/F16C; lowbit_kernels.py):
    rows <= GEMV_MAX_ROWS   (decode steps, small trees: memory-bound) int4/int8: the activations
                            quantized to int8 per block of 64 (int4) or 32 (int8) elements (scale
                            max|x| / 127), multiplied by the codes in integer arithmetic, float32
                            accumulation (int4: weights held in tiles of 8 rows, as Int4Linear
                            holds them where the kernels run, by the AVX2 tiles' loop; weights in
                            rows by AVX-512 VNNI where the CPU has it, else AVX2);
                            fp16: float32 activations, the weights widened in registers, exact products
    more rows               (prefill: compute-bound) a GEMM (`backend.lowbit_prefill`): by default,
                            int4/int8: the activations quantized to int8 per block of 128 (as the
                            small calls, at another block) and multiplied by the int8 weights (int4:
                            q - zero) in integer arithmetic, a float32 step per block
                            (lowbit_kernels.cpp, vnni_gemm: on AVX-512 VNNI int8 products run at
                            twice the bfloat16 rate; on AVX2, vpmaddubsw, ~2x the float32 GEMM's
                            rate on Zen 3); else the weights dequantized a tile at a time into a
                            reused buffer and multiplied by a float32 GEMM (exact float activations
                            over the same quantized weights, the same GEMM as float) or, where the
                            CPU has bfloat16 units, bfloat16 tiles and activations through the
                            bfloat16 GEMM (the numerics of `backend.weights bf16`: input and output
                            rounded to bfloat16, products exact, float32 accumulation); fp16 weights
                            take the bfloat16 or float32 tiles
Anything else (a GPU, float16/bfloat16 pipelines, an ONNX export trace, no kernels): the reference
path, dequantize then F.linear (correct; slower).

Numerics (tests/weights/test_lowbit_weights.py, against float64 recomputations): the small-call kernels
equal float64 x_hat @ dequant(W).T within 1e-5 of the output's largest value, x_hat being the
int8-rounded activations (|x - x_hat| <= block scale / 2 per element, so the result is within
sum_k |dequant(W)[n, k]| * scale_k / 2 of the float-activation product: stated and tested); the
large-call path equals float64 x @ dequant(W).T within 1e-5 in float32, and within 2^-8 of each
output (its bfloat16 rounding) of the bfloat16-rounded inputs' product in bfloat16.

A tied head (logits = h @ E.T) is quantized as the linear layer over E [V, D]; LowBitEmbedding
serves the embedding lookup (rows of the same codes, dequantized) and the head from one copy.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import lowbit_kernels
from ..models.decoder import DecoderLayer
from .bf16 import BF16_UNIT_FLAGS, cpu_has_bf16_units
from .quantize import (
    GROUP_SIZE,
    Int4Weight,
    Int8Weight,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)

log = logging.getLogger("litevlm.weights")

# Rows up to which a call runs the fused small-call kernel (above: dequantized tiles + the float GEMM).
# Measured at InternVL3-2B shapes, 2 threads (litevlm bench --study lowbit_kernels --rows): see docs/performance.md.
GEMV_MAX_ROWS = 16
# float32 bytes of one dequantized weight tile of a large call: tiles of 8 MB (>= 230 rows at a 2B
# model's widest K, 8960) against 2 MB ones (58 rows there, a narrow GEMM): 0.97x against 0.99x of
# float32's prompt time for int4, 0.90x against 1.06x for int8 (2 threads, Zen 4, one run).
TILE_BYTES = 8 << 20
PREFILL_GEMMS = ("auto", "float32", "bfloat16", "int8")


def _exporting() -> bool:
    return torch.compiler.is_exporting() or torch.jit.is_tracing()


class LowBitLinear(nn.Module):
    """Common part of the forms: x [..., K] -> [..., N]; `rows(ids)` gives effective weight rows."""

    in_features: int
    out_features: int
    kind = ""
    prefill_bf16 = False      # many-row calls through the bfloat16 GEMM (set_prefill_gemm)
    prefill_int8 = False      # many-row calls through the int8 GEMM (int4, int8; set_prefill_gemm)
    fused: "Fused | None" = None   # on the first of projections stacked into one call (fuse_projections)

    def _init_common(self, in_features: int, out_features: int, bias: torch.Tensor | None, device) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # decided once (a flag, not a call, so torch.compile traces no Python around it)
        self.kernel = torch.device(device).type == "cpu" and lowbit_kernels.load()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)   # (a decoder's rows: no reshape operators)
        if self.kernel and x.dtype == torch.float32 and not _exporting():
            y = self.kernel_call(rows)
            if self.bias is not None:
                # in place: the kernel's output is a new tensor of ours alone, and a second one as large
                # (100 MB at six vision tiles) costs its page faults and a pass more (2.7x the add)
                y.add_(self.bias)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        y = self.reference(rows).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def kernel_call(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kernel_args(self) -> tuple[list, list[int]] | None:
        """What kernel_call passes, as decode_layer.cpp takes a projection: [w0, w1, w2, pre_quant_scale, bias]
        (None where absent) and [form, group size, tiles8, gemv_max_rows, tile_bytes]; None off the kernels."""
        if not self.kernel:
            return None
        tensors, form = self.form_args()
        return tensors, [*form, GEMV_MAX_ROWS, TILE_BYTES]

    def form_args(self) -> tuple[list, list[int]]:
        raise NotImplementedError

    def reference(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The effective float weight's rows `ids` [T] -> [T, K] (a tied embedding's lookup)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


def to_tiles8(t: torch.Tensor) -> torch.Tensor:
    """Rows [N, C] -> the same elements with each whole 8 rows as a tile [C][8], the last N % 8 rows left
    as rows after the tiles, shaped [N, C] again: int4 codes (as int32 words of 8 codes each), scales and
    zeros in the layout the kernels' int4 small calls stream (lowbit_kernels.cpp, int4_tiles8)."""
    n, c = t.shape
    whole = n // 8 * 8
    tiles = t[:whole].reshape(n // 8, 8, c).transpose(1, 2).reshape(whole, c)
    return torch.cat([tiles, t[whole:]]).contiguous()


def from_tiles8(t: torch.Tensor) -> torch.Tensor:
    """to_tiles8's inverse: [N, C] in tiles of 8 rows -> rows [N, C]."""
    n, c = t.shape
    whole = n // 8 * 8
    rows = t[:whole].reshape(n // 8, c, 8).transpose(1, 2).reshape(whole, c)
    return torch.cat([rows, t[whole:]]).contiguous()


def tiled_rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of a [N, C] tensor in tiles of 8 rows (to_tiles8) -> [T, C], read in place."""
    n, c = t.shape
    col = torch.arange(c, device=ids.device)
    tiled = (ids[:, None] // 8) * (8 * c) + col * 8 + ids[:, None] % 8
    flat = torch.where(ids[:, None] < n // 8 * 8, tiled, ids[:, None] * c + col)
    return t.contiguous().view(-1)[flat]


def words(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K/2] uint8 -> [N, K/8] int32: 4 bytes (8 codes) each, the unit a tile moves."""
    return codes.view(torch.int32)


class Int4Linear(LowBitLinear):
    """Group-wise INT4 weights (quantize.py's format): codes [N, K/2], scales [N, K/G], zeros [N, K/G],
    optional pre_quant_scale [K] (AWQ). Where the kernels run it (`tiles8`), the three are held in tiles
    of 8 rows (to_tiles8: the same bytes, moved at load) for the small calls' loop (lowbit_kernels.cpp,
    int4_tiles8: 1.3-1.9x on a 2B decode step's MLP and head, 2 threads); `weight_form()` and `rows()`
    give them back in rows."""

    kind = "int4"

    def __init__(self, linear: nn.Linear | None = None, *, weight: Int4Weight | None = None,
                 bias: torch.Tensor | None = None, group_size: int = GROUP_SIZE, symmetric: bool = False,
                 in_tiles8: bool | None = None):
        """`in_tiles8`: whether `weight`'s codes, scales and zeros are already in tiles of 8 rows (True) or
        stay in rows (False; stack_projections says which its sources are); None: in tiles where it pays."""
        super().__init__()
        if weight is None:
            weight, bias = quantize_int4(linear.weight, group_size, symmetric), linear.bias
        device = linear.weight.device if linear is not None else weight.codes.device
        n, k = weight.shape
        self._init_common(k, n, bias, device)
        self.group_size = weight.group_size
        self.tiles8 = bool(self.kernel) if in_tiles8 is None else in_tiles8
        tile = to_tiles8 if self.tiles8 and in_tiles8 is None else (lambda t: t)
        self.register_buffer("codes", tile(words(weight.codes.to(device).contiguous())).view(torch.uint8))
        self.register_buffer("scales", tile(weight.scales.to(device)))
        self.register_buffer("zeros", tile(weight.zeros.to(device)))
        pqs = weight.pre_quant_scale
        self.register_buffer("pre_quant_scale", None if pqs is None else pqs.to(device, torch.float32))
        self.kind = f"int4 group {self.group_size}" + (", AWQ pre_quant_scale" if pqs is not None else "")

    def weight_form(self) -> Int4Weight:
        """The weights in quantize.py's row layout (a copy where they are held in tiles of 8 rows)."""
        if not self.tiles8:
            return Int4Weight(self.codes, self.scales, self.zeros, self.group_size, self.pre_quant_scale)
        return Int4Weight(from_tiles8(words(self.codes)).view(torch.uint8), from_tiles8(self.scales),
                          from_tiles8(self.zeros), self.group_size, self.pre_quant_scale)

    def form_args(self):
        tensors = [self.codes, self.scales, self.zeros, self.pre_quant_scale, self.bias]
        return tensors, [4, self.group_size, int(self.tiles8)]

    def kernel_call(self, rows):
        return torch.ops.litevlm_lowbit.int4_linear(rows, self.codes, self.scales, self.zeros, self.pre_quant_scale,
                                                    self.group_size, GEMV_MAX_ROWS, TILE_BYTES, self.prefill_bf16,
                                                    self.prefill_int8, self.tiles8)

    def reference(self, rows):
        xs = rows if self.pre_quant_scale is None else rows * self.pre_quant_scale.to(rows.dtype)
        return F.linear(xs, dequantize_int4(self.weight_form(), rows.dtype))

    def rows(self, ids, dtype):
        g = self.group_size
        if self.tiles8:
            codes = tiled_rows(words(self.codes), ids).contiguous().view(torch.uint8)
            scales, zeros = tiled_rows(self.scales, ids), tiled_rows(self.zeros, ids)
        else:
            codes, scales, zeros = self.codes[ids], self.scales[ids], self.zeros[ids]
        q = unpack_nibbles(codes).to(dtype)
        w = (q - zeros.to(dtype).repeat_interleave(g, 1)) * scales.to(dtype).repeat_interleave(g, 1)
        return w if self.pre_quant_scale is None else w * self.pre_quant_scale.to(dtype)


class Int8Linear(LowBitLinear):
    """Per-channel symmetric INT8 weights: codes [N, K] int8, scales [N] float32."""

    kind = "int8 per-channel"

    def __init__(self, linear: nn.Linear | None = None, *, weight: Int8Weight | None = None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if weight is None:
            weight, bias = quantize_int8(linear.weight), linear.bias
        device = linear.weight.device if linear is not None else weight.codes.device
        n, k = weight.shape
        self._init_common(k, n, bias, device)
        self.register_buffer("codes", weight.codes.to(device))
        self.register_buffer("scales", weight.scales.to(device, torch.float32))

    def form_args(self):
        return [self.codes, self.scales, None, None, self.bias], [8, 0, 0]

    def kernel_call(self, rows):
        return torch.ops.litevlm_lowbit.int8_linear(rows, self.codes, self.scales, GEMV_MAX_ROWS, TILE_BYTES,
                                                    self.prefill_bf16, self.prefill_int8)

    def reference(self, rows):
        return F.linear(rows, dequantize_int8(Int8Weight(self.codes, self.scales), rows.dtype))

    def rows(self, ids, dtype):
        return self.codes[ids].to(dtype) * self.scales[ids].to(dtype)[:, None]


class Fp16Linear(LowBitLinear):
    """float16 weights [N, K], widened to float32 in registers (F16C) at decode."""

    kind = "fp16"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self._init_common(linear.in_features, linear.out_features, linear.bias, linear.weight.device)
        self.register_buffer("weight_fp16", linear.weight.detach().to(torch.float16).contiguous())

    def form_args(self):
        return [self.weight_fp16, None, None, None, self.bias], [16, 0, 0]

    def kernel_call(self, rows):
        return torch.ops.litevlm_lowbit.fp16_linear(rows, self.weight_fp16, GEMV_MAX_ROWS, TILE_BYTES,
                                                    self.prefill_bf16)

    def reference(self, rows):
        return F.linear(rows, self.weight_fp16.to(rows.dtype))

    def rows(self, ids, dtype):
        return self.weight_fp16[ids].to(dtype)


class LowBitEmbedding(nn.Module):
    """A tied embedding + LM head from one low-bit copy of the table E [V, D]: the lookup dequantizes
    rows of it, the head (`logits`) is the low-bit linear layer over it. The interface of
    models.decoder.Embedding."""

    def __init__(self, table: LowBitLinear, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.dtype = dtype                  # of the rows it looks up (the pipeline's)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., D]"""
        return self.table.rows(ids.reshape(-1), self.dtype).reshape(*ids.shape, self.embedding_dim)

    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, D] = rows `ids` [T]"""
        out.copy_(self.table.rows(ids, out.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> [..., V]"""
        return self.table(hidden)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied head: {self.table.kind}"


class Fused(NamedTuple):
    """Projections of one input whose weights are stacked into one low-bit form: `module` over x gives
    the outputs of `sources` side by side, `sizes` wide (models/decoder.project reads it)."""
    sources: tuple[nn.Module, ...]
    module: LowBitLinear
    sizes: tuple[int, ...]


# The per-output-row buffers of each form that can be stacked (the others must be equal across sources).
ROW_BUFFERS = {Int4Linear: ("codes", "scales", "zeros"), Int8Linear: ("codes", "scales")}


def stack_projections(sources: tuple[nn.Module, ...]) -> Fused | None:
    """One low-bit form over `sources` (linears of one input, e.g. q, k, v) with their weight rows
    stacked, or None where they differ in form, group, input width or AWQ scale. The sources' buffers
    become views of the stacked ones (no second copy of the weights). Why: each kernel call of a decode
    step quantizes its input and fans out to the threads once; at InternVL3-2B shapes q, k, v and gate,
    up as two calls instead of five per layer (docs/performance.md, section 1: `--study decode_parts`)."""
    first = sources[0]
    kind = type(first)
    if kind not in ROW_BUFFERS or any(type(m) is not kind or m.in_features != first.in_features
                                      or m.kernel != first.kernel for m in sources):
        return None
    if kind is Int4Linear:
        pqs = [m.pre_quant_scale for m in sources]
        # (in tiles of 8 rows, a source's rows after its last tile would land inside the stack's tiles)
        if any(m.group_size != first.group_size or m.tiles8 != first.tiles8 for m in sources) or (
                first.tiles8 and any(m.out_features % 8 for m in sources)) or not (
                all(p is None for p in pqs) or all(p is not None and torch.equal(p, pqs[0]) for p in pqs)):
            return None
    rows = {name: torch.cat([getattr(m, name) for m in sources]) for name in ROW_BUFFERS[kind]}
    biased = any(m.bias is not None for m in sources)
    bias = torch.cat([m.bias if m.bias is not None else m.codes.new_zeros(m.out_features, dtype=torch.float32)
                      for m in sources]) if biased else None
    if kind is Int4Linear:
        # (each source's rows are whole tiles of 8, so the stacked buffers are in tiles too)
        module = Int4Linear(weight=Int4Weight(rows["codes"], rows["scales"], rows["zeros"], first.group_size,
                                              first.pre_quant_scale), bias=bias, in_tiles8=first.tiles8)
    else:
        module = Int8Linear(weight=Int8Weight(rows["codes"], rows["scales"]), bias=bias)
    module.kernel, module.prefill_bf16, module.prefill_int8 = first.kernel, first.prefill_bf16, first.prefill_int8
    start = 0
    for m in sources:
        end = start + m.out_features
        for name in ROW_BUFFERS[kind]:
            setattr(m, name, getattr(module, name)[start:end])
        if m.bias is not None:
            m.bias = nn.Parameter(module.bias[start:end], requires_grad=False)
        start = end
    return Fused(tuple(sources), module, tuple(m.out_features for m in sources))


def fuse_projections(root: nn.Module) -> int:
    """Stack every decoder layer's projections of one input (DecoderLayer.same_input) into one low-bit
    call where their forms allow (stack_projections); returns how many groups were stacked. Idempotent:
    a group stacked already is kept, and a group whose modules were swapped (LinearForms.use) is
    stacked anew."""
    count = 0
    for layer in root.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        for group in layer.same_input():
            fused = group[0].fused if isinstance(group[0], LowBitLinear) else None
            if fused is None or fused.sources != group:
                fused = stack_projections(group)
                if fused is None:
                    continue
                group[0].fused = fused
            count += 1
    return count


def embedding_as_linear(embedding: nn.Embedding) -> nn.Linear:
    """An nn.Linear view (no copy) of an embedding table E [V, D]: the tied head's weight."""
    linear = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
    linear.weight = embedding.weight
    return linear


def set_prefill_gemm(modules, prefill: str = "auto") -> str:
    """Give every low-bit form under `modules` (None entries skipped) the many-row GEMM `prefill`
    (backend.lowbit_prefill: auto | float32 | bfloat16 | int8); returns the one chosen. auto: int8
    where the kernels run it (wherever they load: AVX-512 VNNI or AVX2), else bfloat16 where the CPU has
    bfloat16 units, else float32. Under int8 the fp16 form, whose weights int8 would round, takes bfloat16
    (or float32)."""
    if prefill not in PREFILL_GEMMS:
        raise ValueError(f"backend.lowbit_prefill {prefill!r}: one of {', '.join(PREFILL_GEMMS)}")
    units = cpu_has_bf16_units()
    int8_gemm = lowbit_kernels.has_int8_gemm()
    if prefill == "auto":
        prefill = "int8" if int8_gemm else "bfloat16" if units else "float32"
    elif prefill == "int8" and not int8_gemm:
        fallback = "bfloat16" if units else "float32"
        log.warning("backend.lowbit_prefill int8 needs the low-bit kernels (%s): the %s GEMM instead",
                    lowbit_kernels.unavailable(), fallback)
        prefill = fallback
    elif prefill == "bfloat16" and units is False:
        log.warning("backend.lowbit_prefill bfloat16 on a CPU without bfloat16 units (no %s in /proc/cpuinfo): "
                    "oneDNN emulates them, slower than float32 here", " or ".join(BF16_UNIT_FLAGS))
    sixteen = prefill == "bfloat16" or (prefill == "int8" and bool(units))     # the fp16 form's under int8
    for root in modules:
        for m in (root.modules() if root is not None else ()):
            if isinstance(m, LowBitLinear):
                for form in (m,) if m.fused is None else (m, m.fused.module):
                    form.prefill_int8 = prefill == "int8" and not isinstance(form, Fp16Linear)
                    form.prefill_bf16 = sixteen if isinstance(form, Fp16Linear) else prefill == "bfloat16"
            elif isinstance(m, DecoderLayer):
                # the prompt's attention in bfloat16 products beside its bfloat16 or int8 GEMMs (models/decoder.py)
                m.bf16_attention = prefill in ("bfloat16", "int8")
    return prefill


def runs_kernels(module: nn.Module) -> bool:
    """Whether `module` (a decoder layer: every layer has the same forms) has low-bit forms on the kernels."""
    return any(isinstance(m, LowBitLinear) and m.kernel for m in module.modules())


@contextmanager
def small_ops_on_one_thread(active: bool = True):
    """A decode step over low-bit kernels: torch's own operators (norms, RoPE, one row's attention, the
    cache copy: microseconds of work each) on the calling thread alone, the kernels on torch's thread
    count. Why: each of those ~140 operators a step woke torch's sleeping (passive) threads for a few
    microseconds of work, a fan-out that costs tens of microseconds and, beside busy processes, waits
    for a thread the scheduler has put aside. Measured at InternVL3-2B shapes, int4, 2 threads (one
    process, alternating): p50 51.7 against 54.8 ms quiet, 59.9 against 83.7 ms beside 2 busy
    processes (p99 135 against 153). Sets torch's thread count for the calling thread only
    (OpenMP's and MKL's counts are per thread) and restores it."""
    threads = torch.get_num_threads()
    if not active or threads == 1:
        yield
        return
    ops = torch.ops.litevlm_lowbit
    before = ops.set_small_call_threads(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        ops.set_small_call_threads(before)
