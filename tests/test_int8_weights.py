"""Int8 weight-only decoding (backend.weights int8): the quantization against its definition, the
matmul against a float64 recomputation, and the pipeline wiring.

Tolerances: |w - q * s| <= s / 2 per element (round to nearest); the int8 matmul equals float64
x_bf16 @ (q * s).T within 1e-5 relative (the kernel's float32 accumulation over K = 256 terms;
x is rounded to bfloat16 first, as the kernel is fed on the CPU: int8_weights.py).
"""

from __future__ import annotations

import pytest
import torch
from export_fixtures import MAX_NEW_TOKENS, lively_checkpoint
from helpers import options, random_frames
from torch import nn

from litevlm_runtime.errors import InputError
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.weights.int8 import FUSED_MAX_ROWS, Int8Linear, quantize_per_channel
from litevlm_runtime.weights.linear_forms import LinearForms, decoder_linears


def test_per_channel_rounding_is_within_half_a_step():
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 96)[:, None]
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (96,)
    assert int(q.abs().max()) == 127                         # each row's largest weight uses the full range
    assert bool(((w - q.float() * s[:, None]).abs() <= s[:, None] / 2 + 1e-7).all())


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 15, 64])     # the int8 kernel (<= FUSED_MAX_ROWS) and the dequantized GEMM
def test_int8_matmul_matches_float64_recomputation(rows):
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        linear.weight.normal_(generator=g)
        linear.bias.normal_(generator=g)
    layer = Int8Linear(linear)
    x = torch.randn(rows, 1, 256, generator=g)
    got = layer(x)
    assert got.shape == (rows, 1, 96) and got.dtype == torch.float32
    q, s = quantize_per_channel(linear.weight)
    if rows <= FUSED_MAX_ROWS:
        # the kernel's inputs and output are bfloat16 (x, scales: rounded first; the output: once, 2^-9)
        xs, ss = x.bfloat16().double(), s.bfloat16().double()
        ref = (xs @ (q.double() * ss[:, None]).T).bfloat16().double() + linear.bias.double()
        bound = 2 ** -8 * (ref - linear.bias.double()).abs() + 1e-5 * ref.abs().max()
    else:
        ref = x.double() @ (q.double() * s.double()[:, None]).T + linear.bias.double()
        bound = 1e-5 * ref.abs().max()
    assert bool(((got.double() - ref).abs() <= bound).all())
    # what the quantization costs against the float layer (stated, not a tolerance of the kernel)
    assert float((got - linear(x)).abs().max() / linear(x).abs().max()) <= 2e-2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return lively_checkpoint(tmp_path_factory.getbasetemp())


def test_pipeline_quantizes_every_decoder_linear(model):
    pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, backend__weights="int8",
                                                   pipeline="baseline"))
    lm = pipe.rt.lm
    assert decoder_linears(lm) == []                      # none left in float
    int8 = [m for m in lm.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 5 * len(lm.layers) + 1            # wqkv, wo, w1, w2, w3 per layer + the LM head
    ans = pipe.answer(random_frames(0), "What is ahead?")
    assert 1 <= len(ans.token_ids) <= MAX_NEW_TOKENS


@torch.inference_mode()
def test_switching_back_to_float_restores_the_float_answers(model):
    pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, pipeline="baseline"))
    frames = random_frames(2)
    ref = pipe.answer(frames, "What is ahead?").token_ids
    weights = LinearForms(pipe.rt.model, ["int8"])
    weights.use("int8")
    first = pipe.rt.engines.decoder.step(torch.ones(1, pipe.rt.cfg.llm.hidden_size), torch.tensor([3]),
                                         torch.tensor([3]), torch.ones(1, 3, dtype=torch.bool),
                                         torch.ones(1, 1, dtype=torch.bool)).clone()
    weights.use("float")
    again = pipe.rt.engines.decoder.step(torch.ones(1, pipe.rt.cfg.llm.hidden_size), torch.tensor([3]),
                                         torch.tensor([3]), torch.ones(1, 3, dtype=torch.bool),
                                         torch.ones(1, 1, dtype=torch.bool)).clone()
    assert not torch.equal(first, again)                  # the int8 weights were really in use
    assert pipe.answer(frames, "What is ahead?").token_ids == ref


def test_int8_with_a_bundle_backend_points_at_calibration():
    with pytest.raises(InputError, match="litevlm calibrate"):
        options(backend__name="onnxruntime", backend__weights="int8")
    with pytest.raises(InputError, match="backend.weights"):
        options(backend__weights="int4")
