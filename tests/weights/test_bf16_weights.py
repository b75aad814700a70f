"""bfloat16 GEMMs for the compute-bound calls (backend.weights bf16): the matmul against a float64
recomputation, the row threshold, and the pipeline wiring (which linears, switching back).

Tolerances: a call of >= BF16_MIN_ROWS rows equals float64 x_bf16 @ w_bf16.T rounded to bfloat16
within 2^-7 relative per element (one bfloat16 ulp: the output's rounding of a float32 sum) + 1e-5
of the largest (float32 accumulation over K terms); a smaller call is the float layer's own result, exactly. What the
rounding costs a whole prefill against float32 is stated (2e-2 of the largest hidden value), not a
kernel tolerance; the accuracy and answer agreement on a fresh seed are in docs/performance.md.
"""

from __future__ import annotations

import pytest
import torch
from helpers import options, random_frames
from torch import nn

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.errors import InputError
from litevlm_runtime.kernels import lowbit_kernels
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.weights.bf16 import BF16_MIN_ROWS, WIDEN_MAX_BYTES, Bf16Linear
from litevlm_runtime.weights.linear_forms import LinearForms, child_linears, weight_bytes
from litevlm_runtime.weights.lowbit import Int8Linear


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, BF16_MIN_ROWS - 1, BF16_MIN_ROWS, 200])
def test_bf16_matmul_matches_float64_recomputation(rows):
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 256, generator=g) * 0.05)
        linear.bias.copy_(torch.randn(96, generator=g))
    layer = Bf16Linear(linear)
    x = torch.randn(rows, 1, 256, generator=g)
    got = layer(x)
    assert got.shape == (rows, 1, 96) and got.dtype == torch.float32
    if rows < BF16_MIN_ROWS:
        assert torch.equal(got, linear(x))                  # memory-bound calls: the float layer, unchanged
        return
    products = x.bfloat16().double() @ linear.weight.bfloat16().double().T
    ref = products.bfloat16().double() + linear.bias.double()
    # One bfloat16 ulp (2^-7 relative): the output's rounding of a float32 sum whose own rounding
    # can put it across a rounding boundary (seen once in 19200 elements on an AVX2 CPU, where
    # oneDNN emulates bfloat16), + float32 accumulation over K terms.
    bound = 2 ** -7 * products.abs() + 1e-5 * products.abs().max()
    assert bool(((got.double() - ref).abs() <= bound).all())
    assert not torch.equal(got, linear(x))                  # the bfloat16 GEMM really ran


@torch.inference_mode()
def test_a_bfloat16_valued_weight_is_read_from_its_copy_in_small_calls():
    """Weights that are bfloat16 values (a checkpoint stored in bfloat16): a small call widens the
    bfloat16 copy and equals the float layer exactly (the same float32 weight, the same kernel);
    weights that are not keep the float weight."""
    g = torch.Generator().manual_seed(11)
    exact = nn.Linear(256, 96)
    with torch.no_grad():
        exact.weight.copy_((torch.randn(96, 256, generator=g) * 0.05).bfloat16().float())
    layer, other = Bf16Linear(exact), Bf16Linear(nn.Linear(256, 96))
    assert layer.widen and not other.widen
    big = nn.Linear(1024, WIDEN_MAX_BYTES // 4 // 1024 + 1)           # too large to widen per call
    with torch.no_grad():
        big.weight.copy_(big.weight.bfloat16().float())
    assert not Bf16Linear(big).widen
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(layer(x), exact(x))
    with torch.no_grad():
        layer.weight_bf16.zero_()                # the small call really reads the copy
    assert torch.equal(layer(x), torch.zeros(3, 96) + exact.bias)


@pytest.fixture(scope="module")
def bundled_float():
    return Pipeline.from_pretrained(DEFAULT_MODEL, options(max_new_tokens=8))


def test_pipeline_converts_the_compute_bound_linears():
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(max_new_tokens=8, backend__weights="bf16"))
    rt = pipe.rt
    assert rt.token_selector is not None and rt.draft is not None
    for part in (rt.model.vision_model, rt.model.mlp1, rt.lm.layers, rt.token_selector, rt.draft):
        assert child_linears([part]) == [], part.__class__.__name__        # none left in float
        assert any(isinstance(m, Bf16Linear) for m in part.modules())
    assert isinstance(rt.lm.head, nn.Linear)                 # the head sees one row: float
    ans = pipe.answer(random_frames(0), "What is in front of the ego car?")
    assert 1 <= len(ans.token_ids) <= 8
    # the bundled checkpoint is stored in bfloat16: a decode step reads the bfloat16 copies too,
    # widened (the roofline's bytes); a float32-valued weight keeps its float weight for them
    layers = list(rt.lm.layers)
    assert all(m.widen for m in rt.lm.layers.modules() if isinstance(m, Bf16Linear))
    assert weight_bytes(layers, many_rows=True) == pytest.approx(weight_bytes(layers), rel=0.01)
    for m in rt.lm.layers.modules():
        if isinstance(m, Bf16Linear):
            m.widen = False
    assert weight_bytes(layers, many_rows=True) * 2 == pytest.approx(weight_bytes(layers), rel=0.01)


@torch.inference_mode()
def test_bf16_changes_many_row_calls_only_and_switches_back(bundled_float):
    pipe = bundled_float
    rt, a = pipe.rt, pipe.rt.arena
    emb = torch.randn(120, rt.cfg.llm.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5

    def prefill():
        return rt.engines.decoder.prefill(emb, a.positions[:120].copy_(torch.arange(120)), a.causal_mask(120)).clone()

    def step():                                             # one row over the prompt prefill left in the cache
        return rt.engines.decoder.step(emb[:1], torch.tensor([120]), torch.tensor([120]), a.all_visible(1, 120),
                                       a.causal_mask(1)).clone()

    frames = random_frames(2)
    ref_answer = pipe.answer(frames, "What is ahead?").token_ids
    float_prefill, float_step = prefill(), step()
    forms = LinearForms(rt.model, ["bf16"], extra=(rt.token_selector, rt.draft))
    try:
        forms.use("bf16")
        bf16_prefill = prefill()
        prefill_then_float = None
        forms.use("float")
        prefill()                                           # the float prompt in the cache again
        forms.use("bf16")
        prefill_then_float = step()                         # a one-row call under bf16 weights
    finally:
        forms.use("float")
    assert not torch.equal(bf16_prefill, float_prefill)                  # the bfloat16 GEMMs ran
    assert float((bf16_prefill - float_prefill).abs().max() / float_prefill.abs().max()) <= 2e-2
    assert torch.equal(prefill_then_float, float_step)                   # a decode step keeps the float weights
    assert pipe.answer(frames, "What is ahead?").token_ids == ref_answer  # float again


def test_bf16_is_refused_where_it_does_not_apply():
    with pytest.raises(InputError, match="backend.weights bf16"):
        options(backend__weights="bf16", dtype="bfloat16")
    with pytest.raises(InputError, match="backend.weights bf16"):
        options(backend__weights="bf16", device="cuda")
    with pytest.raises(InputError, match="exported bundle"):
        options(backend__weights="bf16", backend__name="onnxruntime")


def test_bf16_units_read_from_cpuinfo(tmp_path):
    from litevlm_runtime.weights.bf16 import cpu_has_bf16_units

    amd = tmp_path / "amd"
    amd.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    sapphire = tmp_path / "intel"
    sapphire.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_has_bf16_units(str(amd)) is False
    assert cpu_has_bf16_units(str(sapphire)) is True
    assert cpu_has_bf16_units(str(tmp_path / "absent")) is None


def test_vision_gemm_auto_follows_the_cpu_beside_low_bit_weights():
    """backend.vision_gemm auto beside a low-bit decoder form (its prompt already runs bfloat16 or int8
    GEMMs): int8 where the kernels run AVX-512 VNNI, else bfloat16 where the CPU has bfloat16 units, else
    float32; a float pipeline stays float32; bf16 weights cover vision."""
    from litevlm_runtime.weights.bf16 import cpu_has_bf16_units
    from litevlm_runtime.weights.linear_forms import resolve_vision_gemm

    units = bool(cpu_has_bf16_units())
    f32 = torch.float32
    expected = "int8" if lowbit_kernels.has_vnni() else "bfloat16" if units else "float32"
    assert resolve_vision_gemm("auto", "float", "cpu", f32) == "float32"
    for weights in ("int8", "int4", "int4-rtn", "fp16"):
        assert resolve_vision_gemm("auto", weights, "cpu", f32) == expected
    assert resolve_vision_gemm("auto", "bf16", "cpu", f32) == "bfloat16"
    assert resolve_vision_gemm("bfloat16", "float", "cpu", f32) == "bfloat16"
    assert resolve_vision_gemm("float32", "int4", "cpu", f32) == "float32"
    assert resolve_vision_gemm("auto", "int4", "cpu", torch.bfloat16) == "float32"     # a 16-bit pipeline
    int8_gemm = lowbit_kernels.has_int8_gemm()
    fallback = "bfloat16" if units else "float32"
    assert resolve_vision_gemm("int8", "float", "cpu", f32) == ("int8" if int8_gemm else fallback)
    assert resolve_vision_gemm("int8", "bf16", "cpu", f32) == ("int8" if int8_gemm else "bfloat16")
    with pytest.raises(InputError, match="backend.vision_gemm bfloat16"):
        options(backend__vision_gemm="bfloat16", dtype="bfloat16")
    with pytest.raises(InputError, match="backend.vision_gemm bfloat16"):
        options(backend__vision_gemm="bfloat16", backend__name="onnxruntime")
    with pytest.raises(InputError, match="backend.vision_gemm int8"):
        options(backend__vision_gemm="int8", device="cuda")


@torch.inference_mode()
def test_vision_gemm_bfloat16_converts_the_vision_linears_only(bundled_float):
    """backend.vision_gemm bfloat16 in a float pipeline: the vision encoder's and projector's linears
    become Bf16Linear, the decoder's stay float; the visual tokens within bfloat16's rounding of the
    float32 ones (2e-2 of the largest value over the tower's layers, as a bf16 prefill)."""
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(max_new_tokens=8, backend__vision_gemm="bfloat16"))
    rt = pipe.rt
    assert rt.vision_gemm == "bfloat16"
    for part in (rt.model.vision_model, rt.model.mlp1):
        assert child_linears([part]) == [] and any(isinstance(m, Bf16Linear) for m in part.modules())
    assert not any(isinstance(m, Bf16Linear) for m in rt.lm.modules())
    pixels = torch.randn(rt.arena.pixels[:2].shape, generator=torch.Generator().manual_seed(5))
    ref = bundled_float.rt.engines.vision.run(pixels)
    got = rt.engines.vision.run(pixels)
    assert not torch.equal(got, ref)
    assert float((got - ref).abs().max() / ref.abs().max()) <= 2e-2
    assert bundled_float.rt.vision_gemm == "float32"


@pytest.mark.skipif(not lowbit_kernels.has_int8_gemm(), reason="no low-bit kernels here: vision_gemm int8 falls back")
@torch.inference_mode()
def test_vision_gemm_int8_quantizes_the_vision_linears_per_channel(bundled_float):
    """backend.vision_gemm int8: the vision encoder's and projector's linears as per-channel Int8Linear on the
    int8 GEMM (int8 activations per block of 128); the visual tokens within 5e-2 of the largest float32 value
    (measured 1.0e-2 on the bundled model's tower, bfloat16's 0.4e-2); each linear's own bounds are
    tests/weights/test_lowbit_weights.py's."""
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(max_new_tokens=8, backend__vision_gemm="int8"))
    rt = pipe.rt
    assert rt.vision_gemm == "int8"
    for part in (rt.model.vision_model, rt.model.mlp1):
        forms = [m for m in part.modules() if isinstance(m, Int8Linear)]
        assert child_linears([part]) == [] and forms and all(m.prefill_int8 for m in forms)
    pixels = torch.randn(rt.arena.pixels[:2].shape, generator=torch.Generator().manual_seed(5))
    ref = bundled_float.rt.engines.vision.run(pixels)
    got = rt.engines.vision.run(pixels)
    assert not torch.equal(got, ref)
    assert float((got - ref).abs().max() / ref.abs().max()) <= 5e-2
    ans = pipe.answer(random_frames(0), "What is in front of the ego car?")
    assert 1 <= len(ans.token_ids) <= 8
