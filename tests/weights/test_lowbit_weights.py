"""The low-bit weight forms (backend.weights int4 | int4-rtn | int8 | fp16): the quantizer against its
definition, the CPU kernels against float64 recomputations, AWQ against round to nearest, stored
weights, and the forms end to end on tiny models (InternLM2, Qwen3 with a tied head).

Tolerances (stated in weights/lowbit.py):
  - quantizer: |w - dequant(w)| <= s / 2 per weight (inside its group's range); symmetric codes in
    [-8, 7] + 8; scales float16, rounded up so the range fits.
  - small calls (<= GEMV_MAX_ROWS rows, the int8-activation kernels): equal float64
    x_hat @ dequant(W).T within 1e-5 of the largest |output| (float32 accumulation), x_hat the
    activations rounded to int8 per block of 64 (int4) or 32 (int8) elements (max|x| / 127
    scale), reproduced here exactly; and
    within sum_k |dequant(W)[n, k]| * scale_k / 2 (+ the 1e-5) of the float-activation product.
  - fp16 small calls and every large call (dequantized tiles + float GEMM): float64 x @ dequant(W).T
    within 1e-5 of the largest |output|.
  - large calls through the bfloat16 GEMM (backend.lowbit_prefill bfloat16): float64 x_b @ W_b.T,
    x_b and W_b = dequant(W) rounded to bfloat16 (as torch rounds), within 2^-8 of each |output| (its
    one bfloat16 rounding) + 1e-5 of the largest (float32 accumulation).
  - the int4 small-call kernel's AVX-512 VNNI loop and its AVX2 loop: each within the bounds above.
  - large calls through the int8 GEMM (backend.lowbit_prefill int8; AVX-512 VNNI or AVX2 tiles): the
    small calls' bounds with the activations rounded per block of 128 (64 where the int4 group or K
    asks), in the int4 kernels' even-then-odd order within a block (the same codes).
"""

from __future__ import annotations

import json
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import lively_checkpoint_of, options, random_frames
from torch import nn

from litevlm_runtime.errors import CheckpointError, InputError
from litevlm_runtime.kernels import lowbit_kernels
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.weights.bf16 import cpu_has_bf16_units
from litevlm_runtime.weights.linear_forms import LinearForms, decoder_linears
from litevlm_runtime.weights.lowbit import (
    GEMV_MAX_ROWS,
    Fp16Linear,
    Int4Linear,
    Int8Linear,
    LowBitEmbedding,
    embedding_as_linear,
    from_tiles8,
    set_prefill_gemm,
    small_ops_on_one_thread,
    tiled_rows,
    to_tiles8,
    words,
)
from litevlm_runtime.weights.quantize import (
    awq_quantize,
    dequantize_int4,
    dequantize_int8,
    effective_weight,
    load_quantized,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    save_quantized,
    unpack_nibbles,
)

needs_kernels = pytest.mark.skipif(not lowbit_kernels.load(), reason="low-bit CPU kernels not built here (no "
                                                                     "AVX2/F16C or no compiler): reference path only")
ops = torch.ops.litevlm_lowbit


def weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows of different magnitudes and a few outliers: every group's range differs
    outliers = (torch.rand(n, k, generator=g) < 0.01) * 1.0
    return torch.randn(n, k, generator=g) * torch.linspace(0.01, 0.3, n)[:, None] + outliers


# ------------------------------------------------------------------------------ the quantizer
def test_nibbles_round_trip_in_onnx_order():
    q = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (3, 4)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)          # even k in the low nibble
    assert torch.equal(unpack_nibbles(packed), q)


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_rounding_is_within_half_a_step(symmetric):
    w = weights(40, 256)
    qw = quantize_int4(w, 128, symmetric)
    assert qw.codes.dtype == torch.uint8 and qw.codes.shape == (40, 128)
    assert qw.scales.dtype == torch.float16 and qw.scales.shape == (40, 2) and qw.zeros.shape == (40, 2)
    s = qw.scales.float().repeat_interleave(128, 1)
    err = (w - dequantize_int4(qw)).abs()
    assert bool((err <= s / 2 + 1e-6).all())
    groups = w.view(40, 2, 128)
    if symmetric:
        assert bool((qw.zeros == 8).all())                                 # signed int4 = code - 8
        assert bool((qw.scales.float() >= groups.abs().amax(-1) / 7).all())
    else:
        span = groups.amax(-1).clamp(min=0) - groups.amin(-1).clamp(max=0)
        assert bool((qw.scales.float() >= span / 15).all())               # rounded up: the range fits
        assert int(unpack_nibbles(qw.codes).max()) == 15 and int(unpack_nibbles(qw.codes).min()) == 0


def test_pre_quant_scale_divides_the_weight_and_multiplies_the_input():
    g = torch.Generator().manual_seed(1)
    w, x = weights(24, 128), torch.randn(5, 128, generator=g)
    pqs = torch.rand(128, generator=g) + 0.5
    qw = quantize_int4(w, 128, pre_quant_scale=pqs)
    assert torch.allclose(effective_weight(qw), dequantize_int4(qw) * pqs)
    assert torch.allclose((x * pqs) @ dequantize_int4(qw).T, x @ effective_weight(qw).T, atol=1e-5)
    # w / pqs rounded within s / 2, so w itself within s / 2 * pqs
    s = qw.scales.float().repeat_interleave(128, 1)
    assert bool(((effective_weight(qw) - w).abs() <= s / 2 * pqs + 1e-6).all())


def test_int4_needs_a_group_the_width_divides():
    with pytest.raises(ValueError, match="group size 128"):
        quantize_int4(torch.randn(4, 192), 128)


def test_int8_rounding_is_within_half_a_step():
    w = weights(96, 256)
    qw = quantize_int8(w)
    assert qw.codes.dtype == torch.int8 and int(qw.codes.abs().max()) == 127
    assert bool(((w - dequantize_int8(qw)).abs() <= qw.scales[:, None] / 2 + 1e-7).all())


# ------------------------------------------------------------------------------ kernels
def activation_rounding(x: torch.Tensor, pqs=None, block: int = 32):
    """The kernels' int8 rounding of activations per block (int4 64, int8 32): codes and scales,
    in float32 as they compute them."""
    xs = x if pqs is None else x * pqs
    blocks = xs.view(x.shape[0], -1, block)
    d = blocks.abs().amax(-1) / 127.0
    q = torch.where(d[..., None] > 0, torch.round(blocks / d[..., None].clamp(min=1e-30)), torch.zeros_like(blocks))
    return q.view_as(x), d


def check_small_call(y, x, deq, pqs=None, block=32):
    """y against float64 x_hat @ deq.T (1e-5) and against the float-activation product (the rounding bound)."""
    q, d = activation_rounding(x, pqs, block)
    x_hat = (q.double().view(x.shape[0], -1, block) * d.double()[..., None]).view_as(x)
    ref = x_hat @ deq.double().T
    scale = float(ref.abs().max())
    assert float((y.double() - ref).abs().max()) <= 1e-5 * scale
    exact = (x.double() if pqs is None else x.double() * pqs.double()) @ deq.double().T
    bound = (deq.double().abs() @ (d.double().repeat_interleave(block, 1) / 2).T).T + 1e-5 * scale   # [M, N]
    assert bool(((y.double() - exact).abs() <= bound).all())


@needs_kernels
@pytest.mark.parametrize("block", [32, 64, 128])
def test_activation_rounding_is_reproduced_exactly(block):
    g = torch.Generator().manual_seed(block)
    x = torch.randn(3, 384, generator=g) * torch.linspace(0.1, 5, 384)
    x[1, :block] = 0.0                                                      # an all-zero block
    pqs = torch.rand(384, generator=g) + 0.5
    xq, dx = ops.quantize_activations(x, pqs, block)
    q, d = activation_rounding(x, pqs, block)
    assert torch.equal(xq.float(), q) and torch.equal(dx, d)
    assert bool(((x * pqs - (xq.float().view(3, -1, block) * dx[..., None]).view(3, 384)).abs()
                 <= dx.repeat_interleave(block, 1) / 2 * (1 + 1e-6)).all())


@pytest.fixture(params=["avx512", "avx2"])
def int4_loop(request):
    """The int4 small-call kernel's AVX-512 VNNI loop (where the CPU has it) or its AVX2 loop."""
    on = ops.use_avx512(request.param == "avx512")
    if request.param == "avx512" and not on:
        pytest.skip("no AVX-512 VNNI on this CPU: the int4 kernel runs its AVX2 loop (tested)")
    yield request.param
    ops.use_avx512(True)


@needs_kernels
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 70])
def test_int4_kernel_matches_float64(rows, symmetric, int4_loop):
    w, x = weights(203, 384, seed=rows), torch.randn(rows, 384)           # 203: tiles of 4 and a tail
    pqs = torch.rand(384) + 0.5
    qw = quantize_int4(w, 128, symmetric, pre_quant_scale=pqs)
    y = ops.int4_linear(x, qw.codes, qw.scales, qw.zeros, qw.pre_quant_scale, 128, GEMV_MAX_ROWS, 1 << 16)
    deq = dequantize_int4(qw, torch.float64)
    if rows <= GEMV_MAX_ROWS:
        check_small_call(y, x, deq, pqs, block=64)
    else:
        ref = (x.double() * pqs.double()) @ deq.T
        assert float((y.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def in_tiles8(qw):
    """quantize.py's int4 form -> (codes, scales, zeros) in tiles of 8 rows, as Int4Linear holds them."""
    return to_tiles8(words(qw.codes)).view(torch.uint8), to_tiles8(qw.scales), to_tiles8(qw.zeros)


def test_tiles8_are_the_same_bytes_moved():
    t = torch.arange(27 * 5, dtype=torch.int32).view(27, 5)                 # 3 tiles and 3 rows after them
    tiled = to_tiles8(t)
    assert tiled.shape == t.shape and torch.equal(from_tiles8(tiled), t)
    assert tiled.view(-1)[(1 * 5 + 2) * 8 + 3].item() == t[8 + 3, 2].item()   # tile 1, column 2, its row 3
    assert torch.equal(tiled[24:], t[24:])                                  # the tail stays in rows
    ids = torch.tensor([23, 0, 9, 9, 26, 24])
    assert torch.equal(tiled_rows(tiled, ids), t[ids])


@needs_kernels
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 70])
def test_int4_in_tiles8_matches_float64_and_the_row_layout(rows, group):
    """The weights in tiles of 8 rows (203 rows: 25 tiles and 3 rows after them): small calls within the
    same bounds as the row layout's loop (other float steps, the same integers); large calls (the int8
    GEMM's panels and the dequantized float32 tiles read the tiled bytes) equal to the row layout's to
    the bit, the same numbers moved."""
    w, x = weights(203, 384, seed=rows), torch.randn(rows, 384)
    pqs = torch.rand(384) + 0.5
    qw = quantize_int4(w, group, pre_quant_scale=pqs)
    tiled = in_tiles8(qw)
    for gemm8 in (False, True):
        y = ops.int4_linear(x, *tiled, qw.pre_quant_scale, group, GEMV_MAX_ROWS, 1 << 16, False, gemm8, True)
        if rows <= GEMV_MAX_ROWS:
            check_small_call(y, x, dequantize_int4(qw, torch.float64), pqs, block=64)
        else:
            assert torch.equal(y, ops.int4_linear(x, qw.codes, qw.scales, qw.zeros, qw.pre_quant_scale, group,
                                                  GEMV_MAX_ROWS, 1 << 16, False, gemm8))


@needs_kernels
def test_int4_in_tiles8_holds_at_the_extreme_codes():
    """The tiles' loop sums 4 steps of products in int16 (4 x 2 x 2 x 15 x 127 = 30,480 < 2^15): at every
    code 15 against every activation code 127 the output still equals float64's product."""
    x = torch.full((2, 256), 3.0)
    w = torch.ones(16, 256)
    w[:, ::64] = 0.0                                   # each group's minimum 0: zero point 0, q = 15
    qw = quantize_int4(w, 64)
    assert int(unpack_nibbles(qw.codes).float().mean()) >= 14
    y = ops.int4_linear(x, *in_tiles8(qw), None, 64, GEMV_MAX_ROWS, 1 << 16, False, False, True)
    check_small_call(y, x, dequantize_int4(qw, torch.float64), block=64)


@needs_kernels
def test_int4_group_of_64_runs_the_avx2_loop_on_any_cpu():
    """The AVX-512 loop takes two activation blocks per step, so a group of 64 (one block) runs the AVX2
    loop: the same bounds."""
    w, x = weights(37, 256, seed=5), torch.randn(2, 256)
    qw = quantize_int4(w, 64)
    y = ops.int4_linear(x, qw.codes, qw.scales, qw.zeros, None, 64, GEMV_MAX_ROWS, 1 << 16)
    check_small_call(y, x, dequantize_int4(qw, torch.float64), block=64)


@needs_kernels
@pytest.mark.parametrize("form", ["int4", "int8", "fp16"])
def test_bfloat16_prefill_is_the_bfloat16_product_of_the_same_weights(form):
    """Large calls with prefill_bf16: the product of the bfloat16-rounded activations and dequantized
    weights (torch's rounding), float32 accumulation, each output rounded to bfloat16 once."""
    w, x = weights(203, 384, seed=11), torch.randn(GEMV_MAX_ROWS + 9, 384) * 3
    pqs = torch.rand(384) + 0.5
    if form == "int4":
        qw = quantize_int4(w, 128, pre_quant_scale=pqs)
        args = (qw.codes, qw.scales, qw.zeros, qw.pre_quant_scale, 128, GEMV_MAX_ROWS, 1 << 16)
        call, deq, xs = ops.int4_linear, dequantize_int4(qw, torch.float32), x * pqs
    elif form == "int8":
        qw = quantize_int8(w)
        args = (qw.codes, qw.scales, GEMV_MAX_ROWS, 1 << 16)
        call, deq, xs = ops.int8_linear, dequantize_int8(qw, torch.float32), x
    else:
        h = w.half()
        args, call, deq, xs = (h, GEMV_MAX_ROWS, 1 << 16), ops.fp16_linear, h.float(), x
    y = call(x, *args, True)
    ref = xs.bfloat16().double() @ deq.bfloat16().double().T
    err = (y.double() - ref).abs()
    assert bool((err <= 2.0 ** -8 * ref.abs() + 1e-5 * float(ref.abs().max())).all())
    assert torch.equal(y, y.bfloat16().float())                              # rounded to bfloat16, once
    y32 = call(x, *args, False)                                              # and the float32 tiles: not so
    assert not torch.equal(y32, y32.bfloat16().float())


def test_prefill_gemm_setting_reaches_every_low_bit_form():
    model = nn.Sequential(Int8Linear(nn.Linear(64, 32)), nn.Linear(32, 8), Fp16Linear(nn.Linear(32, 32)))
    assert set_prefill_gemm([model, None], "bfloat16") == "bfloat16"
    assert model[0].prefill_bf16 and model[2].prefill_bf16
    assert set_prefill_gemm([model], "float32") == "float32" and not model[0].prefill_bf16
    assert set_prefill_gemm([model], "auto") in ("float32", "bfloat16", "int8")
    with pytest.raises(ValueError, match="lowbit_prefill 'fp8'"):
        set_prefill_gemm([model], "fp8")
    chosen = set_prefill_gemm([model], "int8")
    if lowbit_kernels.has_int8_gemm():
        # int8 for the int8/int4 forms; the fp16 form's weights stay 16-bit: bfloat16 where the units are
        assert chosen == "int8" and model[0].prefill_int8 and not model[0].prefill_bf16
        assert not model[2].prefill_int8 and model[2].prefill_bf16 == bool(cpu_has_bf16_units())
        assert set_prefill_gemm([model], "auto") == "int8"
    else:                                                   # no kernels: the next GEMM, said in a warning
        assert chosen in ("bfloat16", "float32") and not model[0].prefill_int8
    assert set_prefill_gemm([model], "bfloat16") == "bfloat16" and not model[0].prefill_int8


needs_int8_gemm = pytest.mark.skipif(not lowbit_kernels.has_int8_gemm(), reason="no low-bit kernels here: the int8 "
                                                                                "prefill GEMM does not run")


def int8_gemm_rounding(x: torch.Tensor, block: int, int4_order: bool):
    """x_hat of the int8 GEMM: the kernels' rounding per block, computed in their k order (int4: each
    block's even elements, then its odd ones) and put back in natural order: the same codes."""
    if not int4_order:
        return activation_rounding(x, None, block)
    m, k = x.shape
    order = torch.cat([torch.arange(0, block, 2), torch.arange(1, block, 2)])
    perm = (torch.arange(0, k, block)[:, None] + order).reshape(-1)
    q, d = activation_rounding(x[:, perm], None, block)
    back = torch.empty_like(q)
    back[:, perm] = q
    return back, d


@needs_int8_gemm
@pytest.mark.parametrize("rows,n,k,group", [(GEMV_MAX_ROWS + 1, 203, 384, 128), (33, 37, 256, 64),
                                            (70, 131, 1536, 128), (100, 6, 640, 128)])
def test_int8_prefill_gemm_matches_float64(rows, n, k, group):
    """Large calls with prefill_int8: float64 x_hat @ dequant(W).T within 1e-5 of the largest output, and
    the float-activation product within the rounding bound, for int4 (AWQ scales, a group of 64 where
    given) and int8; row counts that are not a multiple of the GEMM's 32-row tiles, weight rows that are
    not a multiple of its 6-row panels."""
    w, x = weights(n, k, seed=rows + n), torch.randn(rows, k) * torch.linspace(0.2, 4, k)
    pqs = torch.rand(k) + 0.5
    q4 = quantize_int4(w, group, pre_quant_scale=pqs)
    y4 = ops.int4_linear(x, q4.codes, q4.scales, q4.zeros, q4.pre_quant_scale, group, GEMV_MAX_ROWS, 1 << 16,
                         False, True)
    block = 128 if group % 128 == 0 and k % 128 == 0 else 64
    q, d = int8_gemm_rounding(x * pqs, block, int4_order=True)
    check_rounded_product(y4, x * pqs, q, d, block, dequantize_int4(q4, torch.float64))
    q8 = quantize_int8(w)
    y8 = ops.int8_linear(x, q8.codes, q8.scales, GEMV_MAX_ROWS, 1 << 16, False, True)
    block = 128 if k % 128 == 0 else 64
    q, d = int8_gemm_rounding(x, block, int4_order=False)
    check_rounded_product(y8, x, q, d, block, dequantize_int8(q8, torch.float64))
    assert not torch.equal(y8, ops.int8_linear(x, q8.codes, q8.scales, GEMV_MAX_ROWS, 1 << 16))   # the GEMM ran


@needs_int8_gemm
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_prefill_gemm_holds_at_the_extreme_codes(sign):
    """The AVX2 tiles sum two products into int16 (vpmaddubsw) before int32: at the extreme codes (every
    activation code 127, int4 q - zero = 15 against the activations + 128 = 255, int8 codes +-127 by the
    sign trick) the outputs still equal float64's product of the rounded operands: one saturated pair
    would be off by thousands of units."""
    rows, n, k = 40, 13, 256
    x = torch.full((rows, k), 3.0)
    w = torch.full((n, k), sign)
    w[:, ::64] = 0.0                                   # int4: each group's minimum 0, so zero point 0, q = 15
    q4 = quantize_int4(w, 64)
    y4 = ops.int4_linear(x, q4.codes, q4.scales, q4.zeros, None, 64, GEMV_MAX_ROWS, 1 << 16, False, True)
    q, d = int8_gemm_rounding(x, 128, int4_order=True)
    assert int(q.abs().min()) == 127
    check_rounded_product(y4, x, q, d, 128, dequantize_int4(q4, torch.float64))
    q8 = quantize_int8(w)
    assert int(q8.codes.abs().max()) == 127
    y8 = ops.int8_linear(x, q8.codes, q8.scales, GEMV_MAX_ROWS, 1 << 16, False, True)
    check_rounded_product(y8, x, q, d, 128, dequantize_int8(q8, torch.float64))


def check_rounded_product(y, xs, q, d, block, deq):
    """y against float64 x_hat @ deq.T (1e-5 of the largest) and the float-activation product (the bound)."""
    x_hat = (q.double().view(xs.shape[0], -1, block) * d.double()[..., None]).view_as(xs)
    ref = x_hat @ deq.T
    scale = float(ref.abs().max())
    assert float((y.double() - ref).abs().max()) <= 1e-5 * scale
    exact = xs.double() @ deq.T
    bound = (deq.abs() @ (d.double().repeat_interleave(block, 1) / 2).T).T + 1e-5 * scale
    assert bool(((y.double() - exact).abs() <= bound).all())


@needs_int8_gemm
def test_int8_prefill_gemm_gives_the_one_thread_result_on_more_threads():
    """Every output of the int8 GEMM is summed by one thread in one order, whatever the thread count."""
    w, x = weights(301, 1536, seed=3), torch.randn(200, 1536)
    q4, q8 = quantize_int4(w, 128), quantize_int8(w)
    calls = [lambda: ops.int4_linear(x, q4.codes, q4.scales, q4.zeros, None, 128, GEMV_MAX_ROWS, 1 << 20, False, True),
             lambda: ops.int8_linear(x, q8.codes, q8.scales, GEMV_MAX_ROWS, 1 << 20, False, True)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [call() for call in calls]
        torch.set_num_threads(3)
        three = [call() for call in calls]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, three))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, GEMV_MAX_ROWS + 1])
def test_int8_and_fp16_kernels_match_float64(rows):
    w, x = weights(131, 256, seed=rows), torch.randn(rows, 256)
    q8 = quantize_int8(w)
    y8 = ops.int8_linear(x, q8.codes, q8.scales, GEMV_MAX_ROWS, 1 << 16)
    deq8 = dequantize_int8(q8, torch.float64)
    if rows <= GEMV_MAX_ROWS:
        check_small_call(y8, x, deq8)
    else:
        ref = x.double() @ deq8.T
        assert float((y8.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    h = w.half()
    y16 = ops.fp16_linear(x, h, GEMV_MAX_ROWS, 1 << 16)
    ref = x.double() @ h.double().T
    assert float((y16.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@needs_kernels
def test_rows_shared_across_threads_give_the_one_thread_result():
    """Weights above the kernels' 2 MB small-call threshold are split into row chunks across
    threads (the kernels' own helpers, or an OpenMP region with use_row_pool(False)): every output
    is still computed by one thread in one order, so the result is the same to the bit, also with
    more helpers than before, with helpers that wait awake between calls (set_helper_spin_us; where the
    CPU has room, calls from 256 KB up are shared then), with two callers at once (the second runs
    alone), and in a forked child (which has none of its parent's helper threads)."""
    w, x = weights(2104, 2048), torch.randn(2, 2048)               # int4 codes 2.1 MB, int8 4.3 MB
    q4, q8, h = quantize_int4(w, 128), quantize_int8(w), w.half()
    t4 = in_tiles8(q4)
    calls = [lambda: ops.int4_linear(x, q4.codes, q4.scales, q4.zeros, None, 128, GEMV_MAX_ROWS, 1 << 20),
             lambda: ops.int8_linear(x, q8.codes, q8.scales, GEMV_MAX_ROWS, 1 << 20),
             lambda: ops.fp16_linear(x, h, GEMV_MAX_ROWS, 1 << 20),
             lambda: ops.int4_linear(x, *t4, None, 128, GEMV_MAX_ROWS, 1 << 20, False, False, True)]
    threads, spin_default = torch.get_num_threads(), ops.set_helper_spin_us(30)
    try:
        torch.set_num_threads(1)
        one = [call() for call in calls]
        results = {}
        for pool in (True, False):
            ops.use_row_pool(pool)
            for n in (2, 3):
                for spin in (0, 30):
                    ops.set_helper_spin_us(spin)
                    torch.set_num_threads(n)
                    results[(pool, n, spin)] = [call() for _ in range(3) for call in calls][-4:]
        ops.use_row_pool(True)
        torch.set_num_threads(2)
        with ThreadPoolExecutor(2) as callers:
            at_once = list(callers.map(lambda i: calls[i % 4](), range(16)))
        with multiprocessing.get_context("fork").Pool(1) as child:
            forked = child.apply(_calls_in_a_child, (x, q4, q8, h, t4))
    finally:
        ops.use_row_pool(True)
        ops.set_helper_spin_us(spin_default)
        torch.set_num_threads(threads)
    for got in [*results.values(), at_once[-4:], at_once[:4], forked]:
        for a, b in zip(one, got):
            assert torch.equal(a, b)
    for y in (one[0], one[3]):
        check_small_call(y, x, dequantize_int4(q4, torch.float64), block=64)


@needs_kernels
def test_helpers_wait_awake_only_where_the_cpu_has_room():
    """The helpers' spin window (lowbit_kernels.cpp, spin_policy): never beside more busy processes than
    the CPUs this process may use (threads.available_cores, given at load; /proc/loadavg re-read every 50 ms),
    never when set to 0; a negative window and a CPU count under 1 are refused.
    (Whether it spins on a quiet CPU is the machine's to say: CI's cores are shared.)"""
    from litevlm_runtime.bench.contention import Hog
    from litevlm_runtime.threads import available_cores

    before = ops.set_helper_spin_us(30)
    try:
        with Hog(available_cores() + 1):
            time.sleep(0.12)                        # past the policy's 50 ms, the hogs running
            assert [ops.helper_spin_now() for _ in range(3)] == [0, 0, 0]
        ops.set_helper_spin_us(0)
        assert ops.helper_spin_now() == 0
        with pytest.raises(RuntimeError, match="set_helper_spin_us: us >= 0"):
            ops.set_helper_spin_us(-1)
        with pytest.raises(RuntimeError, match="set_cpus_available: cpus >= 1"):
            ops.set_cpus_available(0)
    finally:
        ops.set_helper_spin_us(before)


@needs_kernels
def test_row_pool_waits_count_the_shared_calls_and_are_zeroed_when_read():
    """row_pool_waits: [calls shared with helpers, calls whose caller waited for a helper's chunk, ns
    waited], zeroed by each read; a call on one thread is never shared."""
    w, x = weights(2104, 2048), torch.randn(1, 2048)
    q8 = quantize_int8(w)                                          # 4.3 MB: shared on 2 threads
    threads = torch.get_num_threads()
    try:
        ops.use_row_pool(True)
        torch.set_num_threads(1)
        ops.row_pool_waits()
        ops.int8_linear(x, q8.codes, q8.scales, GEMV_MAX_ROWS, 1 << 20)
        assert list(ops.row_pool_waits()) == [0, 0, 0]
        torch.set_num_threads(2)
        for _ in range(5):
            ops.int8_linear(x, q8.codes, q8.scales, GEMV_MAX_ROWS, 1 << 20)
        calls, waits, wait_ns = ops.row_pool_waits()
        assert calls == 5 and 0 <= waits <= calls and wait_ns >= 0 and (wait_ns > 0) == (waits > 0)
        assert list(ops.row_pool_waits()) == [0, 0, 0]
    finally:
        torch.set_num_threads(threads)


def _calls_in_a_child(x, q4, q8, h, t4):
    torch.set_num_threads(2)
    return [ops.int4_linear(x, q4.codes, q4.scales, q4.zeros, None, 128, GEMV_MAX_ROWS, 1 << 20),
            ops.int8_linear(x, q8.codes, q8.scales, GEMV_MAX_ROWS, 1 << 20),
            ops.fp16_linear(x, h, GEMV_MAX_ROWS, 1 << 20),
            ops.int4_linear(x, *t4, None, 128, GEMV_MAX_ROWS, 1 << 20, False, False, True)]


@torch.inference_mode()
@pytest.mark.parametrize("form", [Int4Linear, Int8Linear, Fp16Linear])
def test_forms_on_the_kernels_equal_their_reference_path(form):
    torch.manual_seed(0)
    linear = nn.Linear(256, 72, bias=True)
    with torch.no_grad():
        linear.weight.copy_(weights(72, 256))
    layer = form(linear)
    x = torch.randn(2, 3, 256)
    got = layer(x)
    assert got.shape == (2, 3, 72)
    want = layer.reference(x.reshape(-1, 256)).reshape(2, 3, 72) + linear.bias
    if layer.kernel and form is not Fp16Linear:          # int8 activations: within the rounding bound
        assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())
    else:
        assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max()))
    # and what the quantization costs against the float layer (stated, not a kernel tolerance)
    # (int4: groups that hold one of weights()'s outliers of 1.0 round their 0.01-0.3 weights coarsely)
    assert float((got - linear(x)).abs().max() / linear(x).abs().max()) <= {Int4Linear: 0.25}.get(form, 0.03)


@torch.inference_mode()
@pytest.mark.parametrize("vocab", [50, 56])                  # int4: 6 tiles of 8 rows and 2 rows, or 7 tiles
@pytest.mark.parametrize("form", [Int4Linear, Int8Linear, Fp16Linear])
def test_tied_embedding_looks_up_the_same_copy_its_head_multiplies(form, vocab):
    emb = nn.Embedding(vocab, 128)
    with torch.no_grad():
        emb.weight.copy_(weights(vocab, 128))
    tied = LowBitEmbedding(form(embedding_as_linear(emb)))
    if form is Int4Linear:
        assert tied.table.tiles8 == lowbit_kernels.load()
    ids = torch.tensor([3, 0, 49, 3])
    table = tied.table.reference(torch.eye(128)).T                          # [V, D]: the effective rows
    assert torch.allclose(tied(ids), table[ids], atol=1e-6)
    out = torch.empty(4, 128)
    tied.lookup(ids, out)
    assert torch.equal(out, tied(ids))
    h = torch.randn(2, 128)
    assert tied.logits(h).shape == (2, vocab)
    assert len([b for b in tied.buffers() if b.numel() >= vocab * 64]) == 1     # one copy of the table


def test_awq_is_never_worse_than_round_to_nearest_and_protects_salient_channels():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = torch.randn(300, 256, generator=g)
    x[:, :8] *= 30.0                                                        # salient input channels
    res = awq_quantize(w, x, 128)
    assert res.error <= res.rtn_error
    assert res.alpha > 0 and res.error < 0.8 * res.rtn_error                # scaling pays on such data
    pqs = res.weight.pre_quant_scale
    assert pqs.shape == (256,) and float(pqs[:8].mean()) < float(pqs[8:].mean())   # salient columns scaled up


# ------------------------------------------------------------------------------ stored weights
def test_stored_weights_round_trip_and_refuse_a_changed_file(tmp_path):
    w = weights(16, 128)
    stored = {"a.int4": quantize_int4(w, 128, pre_quant_scale=torch.rand(128) + 0.5), "b.int8": quantize_int8(w)}
    save_quantized(tmp_path, dict(stored), {"weights": "int4", "method": "awq"})
    manifest, got = load_quantized(tmp_path)
    assert manifest["format"] == "litevlm-lowbit/1" and manifest["modules"]["a.int4"]["group_size"] == 128
    assert torch.equal(got["a.int4"].codes, stored["a.int4"].codes)
    assert torch.equal(got["a.int4"].pre_quant_scale, stored["a.int4"].pre_quant_scale)
    assert torch.equal(got["b.int8"].codes, stored["b.int8"].codes)
    data = (tmp_path / "quantized.safetensors").read_bytes()
    (tmp_path / "quantized.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="sha256"):
        load_quantized(tmp_path)


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def qwen3_tied(tmp_path_factory):
    """tiny-qwen3 (tied head) with std 0.1 weights, so that answers depend on the input."""
    return lively_checkpoint_of(tmp_path_factory.mktemp("lowbit"), "tiny-qwen3")


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from litevlm_runtime.synth.generate import SynthSpec, generate

    out = tmp_path_factory.mktemp("synth_lowbit")
    generate(out, SynthSpec(scenes=2, seed=3, width=160, height=90, val_fraction=0.0), workers=1, progress=False)
    return out


@pytest.mark.parametrize("kind", ["int4-rtn", "int8", "fp16"])
def test_tied_head_pipeline_quantizes_every_decoder_weight(qwen3_tied, kind):
    frames = random_frames(0)
    ref = Pipeline.from_pretrained(qwen3_tied, options(max_new_tokens=6, pipeline="baseline"))
    pipe = Pipeline.from_pretrained(qwen3_tied, options(max_new_tokens=6, pipeline="baseline", backend__weights=kind))
    lm = pipe.rt.lm
    assert decoder_linears(lm) == []                                        # none left in float
    assert isinstance(lm.embed, LowBitEmbedding)                            # the tied head and its lookup
    vocab, d = lm.cfg.vocab_size, lm.cfg.hidden_size
    assert not [p for p in lm.parameters() if p.shape == (vocab, d)]        # no float copy of the table kept
    got, want = pipe.answer(frames, "What is ahead?"), ref.answer(frames, "What is ahead?")
    assert 1 <= len(got.token_ids) <= 6 and got.text.strip() != ""
    if kind == "fp16":      # fp16 weights of a std-0.1 model: far within the logits' margins here
        assert got.token_ids == want.token_ids


@needs_kernels
@torch.inference_mode()
def test_decode_step_with_torch_ops_on_one_thread_is_the_same_step(qwen3_tied):
    """The torch engine's decode step over low-bit kernels runs torch's own operators on one thread
    (small_ops_on_one_thread): the same hidden rows as with every operator on torch's threads (within
    1e-6 of the largest: reductions may split differently), and the thread counts restored after."""
    from litevlm_runtime.engines.torch_engine import step_eager

    pipe = Pipeline.from_pretrained(qwen3_tied, options(max_new_tokens=2, pipeline="baseline",
                                                        backend__weights="int4-rtn", backend__threads=2))
    rt, a = pipe.rt, pipe.rt.arena
    x = torch.randn(3, rt.cfg.llm.hidden_size)
    args = (x, a.positions[40:43], a.slots[40:43], a.all_visible(3, 40), a.causal_mask(3))
    threads = torch.get_num_threads()
    want = step_eager(rt.lm, a.k_cache.clone(), a.v_cache.clone(), *args)
    got = rt.engines.decoder.step(*args)
    assert torch.get_num_threads() == threads and ops.set_small_call_threads(0) == 0
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    with pytest.raises(RuntimeError, match="boom"), small_ops_on_one_thread():
        assert threads == 1 or torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == threads


def test_quantize_command_stores_awq_weights_the_pipeline_loads(qwen3_tied, synth, tmp_path, capsys):
    from litevlm_runtime.cli import main

    out = tmp_path / "q"
    rc = main(["quantize", "--model", str(qwen3_tied), "--data", str(synth / "train.json"), "--out", str(out),
               "--questions", "3", "--rows", "64", "--max_new_tokens", "4"])
    assert rc == 0 and "int4 weights" in capsys.readouterr().out
    manifest = json.loads((out / "quantization.json").read_text())
    assert manifest["weights"] == "int4" and manifest["method"] == "awq" and manifest["group_size"] == 128
    assert manifest["calibration"]["questions"] == 3 and manifest["calibration"]["rows_seen"] > 64
    methods = [m["method"] for m in manifest["modules"].values()]
    assert methods.count("awq") == 7 * 2 and any("tied" in m for m in methods)  # 7 linears x 2 layers; tied head RTN
    pipe = Pipeline.from_pretrained(qwen3_tied, options(max_new_tokens=4, pipeline="baseline", backend__weights="int4",
                                                        backend__quantized=str(out)))
    layer = pipe.rt.lm.layers[0].self_attn.q_proj
    assert isinstance(layer, Int4Linear) and layer.pre_quant_scale is not None
    assert 1 <= len(pipe.answer(random_frames(1), "Is the road clear?").token_ids) <= 4


def test_int4_without_stored_weights_names_the_command(qwen3_tied, tmp_path):
    with pytest.raises(InputError, match="litevlm quantize"):
        Pipeline.from_pretrained(qwen3_tied, options(pipeline="baseline", backend__weights="int4"))
    save_quantized(tmp_path, {"x": quantize_int8(torch.randn(4, 32))}, {"weights": "int8"})
    with pytest.raises(CheckpointError, match="holds int8 weights"):
        Pipeline.from_pretrained(qwen3_tied, options(pipeline="baseline", backend__weights="int4",
                                                     backend__quantized=str(tmp_path)))
    with pytest.raises(InputError, match="backend.weights int4"):
        options(backend__name="onnxruntime", backend__weights="int4")


@torch.inference_mode()
def test_forms_switch_in_place_and_back(qwen3_tied):
    pipe = Pipeline.from_pretrained(qwen3_tied, options(max_new_tokens=4, pipeline="baseline"))
    frames = random_frames(2)
    ref = pipe.answer(frames, "What is ahead?").token_ids
    forms = LinearForms(pipe.rt.model, ["int8", "int4-rtn", "fp16"])
    for kind in ("int8", "int4-rtn", "fp16"):
        forms.use(kind)
        assert isinstance(pipe.rt.lm.embed, LowBitEmbedding)
        assert 1 <= len(pipe.answer(frames, "What is ahead?").token_ids) <= 4
    forms.use("float")
    assert pipe.answer(frames, "What is ahead?").token_ids == ref


@needs_kernels
@torch.inference_mode()
@pytest.mark.parametrize("kind", ["int4-rtn", "int8"])
def test_projections_of_one_input_run_as_one_call(qwen3_tied, kind):
    """Each layer's q, k, v and gate, up are stacked into one low-bit form (fuse_projections): the
    projections' buffers are views of the stacked ones (no second copy of the weights), a decode row
    and a prompt's rows give what the projections give one by one (exactly on the small-call kernel,
    within 1e-6 of the largest on the prompt's GEMM), and so does a whole answer."""
    from litevlm_runtime.models.decoder import project

    pipe = Pipeline.from_pretrained(qwen3_tied, options(max_new_tokens=6, pipeline="baseline", backend__weights=kind))
    lm = pipe.rt.lm
    for layer in lm.layers:
        for group in layer.same_input():
            fused = group[0].fused
            assert fused is not None and fused.sources == group and sum(fused.sizes) == fused.module.out_features
            stacked = fused.module.codes.untyped_storage().data_ptr()
            assert all(m.codes.untyped_storage().data_ptr() == stacked for m in group)
            assert fused.module.prefill_int8 == group[0].prefill_int8
    for rows in (1, 3 * GEMV_MAX_ROWS):
        x = torch.randn(rows, lm.cfg.hidden_size)
        for group in lm.layers[1].same_input():
            for got, want in zip(project(x, group), [m(x) for m in group]):
                tol = 0.0 if rows <= GEMV_MAX_ROWS else 1e-6 * float(want.abs().max())
                assert got.shape == want.shape and float((got - want).abs().max()) <= tol
    frames = random_frames(3)
    fused_ids = pipe.answer(frames, "What is ahead?").token_ids
    for layer in lm.layers:
        for group in layer.same_input():
            group[0].fused = None
    assert pipe.answer(frames, "What is ahead?").token_ids == fused_ids
    assert 1 <= len(fused_ids) <= 6
