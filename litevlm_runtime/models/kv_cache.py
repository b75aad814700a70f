"""A quantized KV cache: K and V stored as 8-bit codes with one scale per head and row, read back
dequantized by attention (`arena.kv_dtype` int8 | fp8; float keeps plain tensors).

    codes   [..., S, D]   int8 (symmetric, round half to even, [-127, 127]) or FP8 E4M3 (round to
                          nearest even; kept as its bit pattern in uint8, which every runtime binds)
    scales  [..., S]      float16: per (layer, KV head, row), amax(row) / 127 or amax(row) / 448
    value   = codes * scales[..., None]

Per head and row, not per tensor: a row is written once, when its token enters the cache, so its
scale is known then and never revised (no calibration), and one outlier token cannot coarsen the
others' steps. The scale is rounded to float16 first and the codes computed with the rounded
scale (rounded up, so the row's largest element still fits), so a row dequantizes to exactly
what was quantized against. Memory per row: D bytes + 2
against 2D (float16) or 4D (float32): at head_dim 128, 0.508 of a float16 cache.

`QuantizedKV` behaves as the cache tensor does where the runtime touches one: indexing and slicing
over every dimension but the last (views stay views: `k[0]`, `k[:, :, :L]`, `k[regions, :, :,
slots] = rows`), `index_copy_`, `copy_`, `transpose`, `unbind`, assigning float rows (quantized on
the way in) or another QuantizedKV's rows (copied exactly: prefix reuse, conversation turns,
EAGLE-2's accepted rows keep their codes). Attention reads `dequantize()` (models/decoder.py); the
rows a call writes are attended to in float within that call and quantized when stored, in every
backend alike (graphs take codes and scales as inputs and return float rows; the engine stores
them through this class: engines/bound_stages.py).
"""

from __future__ import annotations

import torch

KV_DTYPES = ("float", "int8", "fp8")
CODE_DTYPE = {"int8": torch.int8, "fp8": torch.uint8}
QMAX = {"int8": 127.0, "fp8": 448.0}
SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0 ** -14            # float16's smallest normal: a near-zero row keeps a usable scale


def fp8_decode(bits: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns [...] (any integer dtype) -> their float32 values, by arithmetic: sign bit
    7, exponent bits 3..6 (bias 7), mantissa bits 0..2; exponent 0 is subnormal (2^-6 * m / 8).
    Exact in float32 for every finite pattern; the two NaN patterns (never written: codes are
    clamped to +-448) decode to +-480. Written out because ONNX has no bit cast to float8 that a
    graph can apply to a uint8 input, and a 256-entry table lookup would make int64 indices of
    the whole cache on every step (tests/models/test_kv_cache.py checks it against ml_dtypes)."""
    c = bits.to(torch.float32)
    negative = c >= 128.0
    c = torch.where(negative, c - 128.0, c)
    exponent = torch.floor(c / 8.0)
    mantissa = c - exponent * 8.0
    normal = torch.pow(2.0, exponent - 7.0) * (1.0 + mantissa / 8.0)
    value = torch.where(exponent > 0, normal, mantissa * 2.0 ** -9)
    return torch.where(negative, -value, value)


def float16_up(s: torch.Tensor) -> torch.Tensor:
    """s (float32, >= MIN_SCALE) rounded up to float16: the next float16 >= s, so amax / scale <= qmax."""
    h = s.clamp(max=65504.0).to(SCALE_DTYPE)
    low = h.float() < s
    return torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def quantize_rows(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (codes [..., D], scales [...] float16) as described above. Bounds, per
    element: int8 |x - value| <= scale / 2; fp8 <= 2^-4 |x| (3 mantissa bits, nearest even), and
    scale * 2^-10 below E4M3's smallest normal (tests/models/test_kv_cache.py, against float64)."""
    amax = x.detach().float().abs().amax(-1)
    scales = float16_up((amax / QMAX[kind]).clamp_(min=MIN_SCALE))
    scaled = x.float() / scales.float()[..., None]
    if kind == "int8":
        return torch.round(scaled).clamp_(-127, 127).to(torch.int8), scales
    return scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8), scales


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D], scales [...] -> values [..., D] in dtype. FP8 bit patterns are read through a
    in a traced graph decoded arithmetically (fp8_decode: ONNX has no bit cast that ONNX Runtime runs;
    exact), through torch's own float8 view when eager."""
    if codes.dtype == torch.int8:
        values = codes.to(dtype)
    elif torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing():
        values = fp8_decode(codes).to(dtype)
    else:
        values = codes.view(torch.float8_e4m3fn).to(dtype)
    return values * scales.to(dtype)[..., None]


def kind_of(codes: torch.Tensor) -> str:
    return "int8" if codes.dtype == torch.int8 else "fp8"


class QuantizedKV:
    """codes [..., S, D] with scales [..., S]; see the module docstring."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        if codes.shape[:-1] != scales.shape:
            raise ValueError(f"KV codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match")
        self.codes, self.scales = codes, scales

    @classmethod
    def zeros(cls, shape, kind: str, device) -> "QuantizedKV":
        return cls(torch.zeros(shape, dtype=CODE_DTYPE[kind], device=device),
                   torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device))

    @classmethod
    def of(cls, x: torch.Tensor, kind: str) -> "QuantizedKV":
        return cls(*quantize_rows(x, kind))

    @property
    def kind(self) -> str:
        return kind_of(self.codes)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dim(self) -> int:
        return self.codes.dim()

    def data_ptr(self) -> int:
        return self.codes.data_ptr()

    def element_size(self) -> float:
        """Bytes per cached element, its row's scale included: (D + 2) / D for 8-bit codes."""
        return self.codes.element_size() + self.scales.element_size() / self.codes.shape[-1]

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_codes(self.codes, self.scales, dtype)

    def _key(self, key):
        """The same index for the scales: it never reaches the last (head_dim) dimension."""
        parts = key if isinstance(key, tuple) else (key,)
        if any(p is Ellipsis for p in parts) or len(parts) >= self.codes.dim():
            raise IndexError("a quantized KV cache is indexed over its leading dimensions only")
        return key

    def __getitem__(self, key) -> "QuantizedKV":
        key = self._key(key)
        return QuantizedKV(self.codes[key], self.scales[key])

    def __setitem__(self, key, value) -> None:
        key = self._key(key)
        codes, scales = self._rows(value)
        self.codes[key] = codes
        self.scales[key] = scales

    def _rows(self, value) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(value, QuantizedKV):
            if value.codes.dtype != self.codes.dtype:
                raise TypeError(f"copying {value.kind} KV rows into a {self.kind} cache")
            return value.codes, value.scales
        return quantize_rows(value, self.kind)

    def index_copy_(self, dim: int, index: torch.Tensor, source) -> "QuantizedKV":
        if dim < 0 or dim >= self.codes.dim() - 1:
            raise IndexError("a quantized KV cache is indexed over its leading dimensions only")
        codes, scales = self._rows(source)
        self.codes.index_copy_(dim, index, codes)
        self.scales.index_copy_(dim, index, scales)
        return self

    def copy_(self, source) -> "QuantizedKV":
        codes, scales = self._rows(source)
        self.codes.copy_(codes)
        self.scales.copy_(scales)
        return self

    def clone(self) -> "QuantizedKV":
        return QuantizedKV(self.codes.clone(), self.scales.clone())

    def zero_(self) -> "QuantizedKV":
        self.codes.zero_()
        self.scales.zero_()
        return self

    def transpose(self, a: int, b: int) -> "QuantizedKV":
        last = self.codes.dim() - 1
        if last in (a % self.codes.dim(), b % self.codes.dim()):
            raise IndexError("a quantized KV cache's head_dim stays last")
        return QuantizedKV(self.codes.transpose(a, b), self.scales.transpose(a, b))

    def unbind(self, dim: int = 0) -> tuple["QuantizedKV", ...]:
        return tuple(QuantizedKV(c, s) for c, s in zip(self.codes.unbind(dim), self.scales.unbind(dim)))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes, self.scales


def kv_zeros(shape, kind: str, dtype: torch.dtype, device):
    """The cache buffer of one arena region set: a float tensor (kind float) or a QuantizedKV."""
    if kind == "float":
        return torch.zeros(shape, dtype=dtype, device=device)
    if kind not in CODE_DTYPE:
        raise ValueError(f"kv dtype {kind!r}: one of {', '.join(KV_DTYPES)}")
    return QuantizedKV.zeros(shape, kind, device)


def read(cache, dtype: torch.dtype):
    """A layer's cache as attention reads it: float as is, a QuantizedKV dequantized."""
    return cache.dequantize(dtype) if isinstance(cache, QuantizedKV) else cache


def random_like(cache, shape=None, dtype: torch.dtype = torch.float32):
    """Random cache contents of `cache`'s kind and device, of its shape or `shape` (export examples)."""
    values = torch.randn(tuple(shape or cache.shape), dtype=dtype, device=cache.device)
    return QuantizedKV.of(values, cache.kind) if isinstance(cache, QuantizedKV) else values


def cache_inputs(name: str, cache) -> dict[str, torch.Tensor]:
    """A cache as graph inputs: {name: tensor}, or {name: codes, name + "_scale": scales}."""
    if isinstance(cache, QuantizedKV):
        return {name: cache.codes, f"{name}_scale": cache.scales}
    return {name: cache}


def wrap(cache: torch.Tensor, scales: torch.Tensor | None):
    """The inverse of cache_inputs inside a stage module: codes and scales back into a QuantizedKV."""
    return cache if scales is None else QuantizedKV(cache, scales)
