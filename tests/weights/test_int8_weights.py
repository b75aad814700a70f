"""Int8 weight-only decoding (backend.weights int8) on an InternLM2 model (untied head): the pipeline
wiring. The quantizer and the kernels' numerics are in test_lowbit_weights.py (float64 references).
"""

from __future__ import annotations

import pytest
import torch
from helpers import options, random_frames
from helpers.export import MAX_NEW_TOKENS, lively_checkpoint

from litevlm_runtime.errors import InputError
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.weights.linear_forms import LinearForms, decoder_linears
from litevlm_runtime.weights.lowbit import Int8Linear


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
        options(backend__weights="int2")
