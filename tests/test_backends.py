"""ONNX Runtime backend against the PyTorch backend: stage by stage (fp32) and whole answers.

Metric for stage equivalence: max |onnxruntime - torch| / max |torch| over the whole output
tensor (relative to the output's scale), required <= 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from export_fixtures import MAX_NEW_TOKENS, exported_bundle, lively_checkpoint, pipelines
from helpers import random_frames

from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS
from litevlm_runtime.errors import LiteVLMError

TOLERANCE = 1e-4


@torch.no_grad()
def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    return pipelines(lively_checkpoint(root), exported_bundle(root))


@pytest.mark.parametrize("tiles", [3, 4, 6])   # 3 runs in the 4-tile bucket, padded
def test_vision_stage_matches_torch(pipes, tiles):
    torch_pipe, ort_pipe = pipes
    s = torch_pipe.rt.cfg.force_image_size
    pixels = torch.randn(tiles, 3, s, s, generator=torch.Generator().manual_seed(tiles))
    ref = torch_pipe.rt.engines.vision.run(pixels)
    got = ort_pipe.rt.engines.vision.run(pixels)
    assert got.shape == ref.shape
    assert relative_error(got, ref) <= TOLERANCE


def fill_caches(pipe, seed):
    g = torch.Generator().manual_seed(seed)
    a = pipe.rt.arena
    a.k_cache.copy_(torch.randn(a.k_cache.shape, generator=g))
    a.v_cache.copy_(torch.randn(a.v_cache.shape, generator=g))


def test_decoder_stage_matches_torch(pipes):
    """A prefill (100 rows in the 256 bucket), a decode step, and a 5-node tree (8 bucket) under an
    ancestor mask in scratch slots; the hidden states and the whole KV caches must agree.
    The caches start full of random values so that a stale entry leaking through the mask shows."""
    torch_pipe, ort_pipe = pipes
    for p in pipes:
        fill_caches(p, 0)
    d = torch_pipe.rt.cfg.llm.hidden_size
    g = torch.Generator().manual_seed(1)
    n = 100
    # a prefill: no earlier cache, a causal prompt (positions with gaps, as after token selection)
    prefill = (torch.randn(n, d, generator=g), torch.arange(n) * 2, torch.ones(n, n, dtype=torch.bool).tril_())
    # decode step: one row at slot n attending to every slot before it
    steps = [(torch.randn(1, d, generator=g), torch.tensor([2 * n]), torch.tensor([n]),
              torch.ones(1, n, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool))]
    # tree: root + two children + two grandchildren in scratch slots 130..134, over slots < n + 1
    parents = [-1, 0, 0, 1, 2]
    ancestors = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            ancestors[i, j] = True
            j = parents[j]
    depth = torch.tensor([0, 1, 1, 2, 2])
    steps.append((torch.randn(5, d, generator=g), 2 * n + 1 + depth, torch.arange(130, 135),
                  torch.ones(5, n + 1, dtype=torch.bool), ancestors))

    def check(outs, rows):
        assert outs[1].shape == outs[0].shape == (rows, d)
        assert relative_error(outs[1], outs[0]) <= TOLERANCE
        ka, kb = ort_pipe.rt.arena, torch_pipe.rt.arena
        assert relative_error(ka.k_cache, kb.k_cache) <= TOLERANCE
        assert relative_error(ka.v_cache, kb.v_cache) <= TOLERANCE

    check([p.rt.engines.decoder.prefill(*prefill).clone() for p in pipes], n)
    for embeds, positions, slots, mask_cache, mask_new in steps:
        check([p.rt.engines.decoder.step(embeds, positions, slots, mask_cache, mask_new).clone() for p in pipes],
              embeds.shape[0])


@pytest.mark.parametrize("rows", [1, 5, 8])
def test_head_stage_matches_torch(pipes, rows):
    torch_pipe, ort_pipe = pipes
    hidden = torch.randn(rows, torch_pipe.rt.cfg.llm.hidden_size, generator=torch.Generator().manual_seed(rows))
    ref = torch_pipe.rt.engines.head.run(hidden)
    got = ort_pipe.rt.engines.head.run(hidden)
    assert got.shape == ref.shape
    assert relative_error(got, ref) <= TOLERANCE


def test_answers_identical_to_torch(pipes):
    torch_pipe, ort_pipe = pipes
    answers = []
    for i, question in enumerate(DEFAULT_QUESTIONS[:6]):
        frames = random_frames(i)
        ref, got = torch_pipe.answer(frames, question), ort_pipe.answer(frames, question)
        assert got.token_ids == ref.token_ids, question
        assert got.text == ref.text
        assert 1 <= len(ref.token_ids) <= MAX_NEW_TOKENS
        answers.append(tuple(ref.token_ids))
    # the comparison means something only if answers depend on the input
    assert len(set(answers)) >= 4


def test_bucket_overflow_is_a_clear_error(pipes):
    _, ort_pipe = pipes
    hidden = torch.zeros(9, ort_pipe.rt.cfg.llm.hidden_size)
    with pytest.raises(LiteVLMError, match="largest shape bucket 8"):
        ort_pipe.rt.engines.head.run(hidden)


def test_backend_needs_a_bundle(tmp_path_factory):
    from helpers import options

    from litevlm_runtime.pipeline.pipeline import Pipeline

    model = lively_checkpoint(tmp_path_factory.getbasetemp())
    with pytest.raises(LiteVLMError, match="litevlm export"):
        Pipeline.from_pretrained(model, options(backend__name="onnxruntime"))
    with pytest.raises(LiteVLMError, match="backend.name: 'tpu' is not one of"):
        Pipeline.from_pretrained(model, options(backend__name="tpu"))
    with pytest.raises(LiteVLMError, match="tensorrt runs on a CUDA device"):
        Pipeline.from_pretrained(model, options(backend__name="tensorrt", backend__bundle="b"))


def test_follow_up_on_onnxruntime_equals_torch(pipes):
    """A follow-up's new rows run as decode steps over the restored KV, in calls of at most the
    bundle's largest step bucket (8 rows here): the same answer as torch's follow-up and as the
    conversation from scratch (on torch: the whole conversation is past this bundle's one
    256-row prefill bucket, which a follow-up never uses)."""
    torch_pipe, ort_pipe = pipes
    images = random_frames(3)
    got = {}
    for name, pipe in (("torch", torch_pipe), ("onnxruntime", ort_pipe)):
        first = pipe.answer(images, DEFAULT_QUESTIONS[0], turn_id="t1")
        follow = pipe.answer(images, DEFAULT_QUESTIONS[1], follow_up_of="t1")
        assert follow.input_tokens > 8 and follow.reused_tokens > 0
        got[name] = (first.token_ids, follow.token_ids, first.text)
    assert got["onnxruntime"] == got["torch"]
    scratch = torch_pipe.answer(images, DEFAULT_QUESTIONS[1], history=[(DEFAULT_QUESTIONS[0], got["torch"][2])])
    assert scratch.token_ids == got["onnxruntime"][1]
