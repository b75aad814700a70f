"""The prompt prefix every query shares (pipeline/prefix.py), on the bundled model: a prefill that
takes its KV gives every prompt row's features and the KV of a full prefill of the same prompt
within 1e-5 (float32); a query reuses exactly the rows its own prompt begins with (the probe's
first camera label too when its first camera is the same); greedy answers with the prefix equal
those without it in the deployed configuration (views, tokens r=0.8, EAGLE-2) and with every
token; the prefix is computed once into the arena; FastV and graph prefills do not reuse it."""

from dataclasses import replace

import pytest
import torch
from helpers import options, random_frames

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.engines.bound_stages import BoundDecoder
from litevlm_runtime.pipeline.pipeline import (
    Pipeline,
    assemble_prompt,
    encode,
    prefill,
    preprocess,
    prompt_ids,
    select_tokens,
)

QUESTIONS = ["What are the important objects in the current scene?", "Is there a pedestrian behind the ego car?",
             "What should the ego vehicle do next?", "Is the traffic light ahead red or green?"]


@pytest.fixture(scope="module")
def frames():
    return [random_frames(s, 270, 480) for s in (3, 4)]


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("cameras", [["CAM_FRONT"], ["CAM_BACK", "CAM_FRONT_LEFT"]])
def test_prefill_after_the_prefix_equals_a_full_prefill(frames, cameras):
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(decoding__mode="greedy", dtype="float32"))
    rt, a = pipe.rt, pipe.rt.arena
    prefix = rt.prefix
    assert prefix is not None and a.prefix_k.shape[2] == len(prefix.ids)
    question = QUESTIONS[0]
    with torch.inference_mode():
        visual = encode(rt, preprocess(rt, frames[0], cameras), cameras, {}, cameras)
        layout = assemble_prompt(rt, cameras, question, visual)
        keep = select_tokens(rt, layout)
        a.k_cache.zero_(), a.v_cache.zero_()
        shared = prefill(rt, rt.region(0), layout, keep)
        n = shared.length
        hidden, k, v = shared.hidden.clone(), a.k_cache[:, :, :n].clone(), a.v_cache[:, :, :n].clone()
        a.k_cache.zero_(), a.v_cache.zero_()
        whole = prefill(replace(rt, prefix=None), rt.region(0), layout, keep)
    # Reused: the rows this prompt and the probe's (first camera CAM_FRONT) begin with, counted
    # from the prompt builder's own ids.
    ids, spans = prompt_ids(rt, cameras, question)
    probe_ids, probe_spans = prompt_ids(rt, ["CAM_FRONT"], question)
    expected = common_prefix(ids[:spans[0][0]], probe_ids[:probe_spans[0][0]])
    assert shared.shared == expected and whole.shared == 0
    assert (expected == len(prefix.ids)) == (cameras[0] == "CAM_FRONT")
    assert 20 < expected < n
    assert shared.first == whole.first
    assert hidden.shape == whole.hidden.shape == (n, rt.cfg.llm.hidden_size)
    assert (hidden - whole.hidden).abs().max().item() <= 1e-5
    assert (k - a.k_cache[:, :, :n]).abs().max().item() <= 1e-5
    assert (v - a.v_cache[:, :, :n]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("settings", [{}, {"tokens__mode": "off"}], ids=["deployed", "every-token"])
def test_answers_equal_those_without_the_prefix(frames, settings):
    on = Pipeline.from_pretrained(DEFAULT_MODEL, options(**settings))
    off = Pipeline.from_pretrained(DEFAULT_MODEL, options(serving__prefix_cache=False, **settings))
    assert off.rt.prefix is None and off.rt.arena.prefix_k.shape[2] == 0
    buffer = on.rt.arena.prefix_k.data_ptr()
    kept = on.rt.arena.prefix_k.clone()
    for f in frames:
        for q in QUESTIONS:
            got, want = on.answer(f, q), off.answer(f, q)
            assert got.token_ids == want.token_ids, (q, got.text, want.text)
    assert on.rt.arena.prefix_k.data_ptr() == buffer and torch.equal(on.rt.arena.prefix_k, kept)   # computed once


def test_fastv_and_graph_prefills_do_not_reuse_it():
    fastv = Pipeline.from_pretrained(DEFAULT_MODEL, options(fastv__ratio=0.5, pipeline="baseline"))
    assert fastv.rt.prefix is None and fastv.rt.arena.prefix_k.shape[2] == 0
    graphs = object.__new__(BoundDecoder)
    graphs.prefill_sizes = (64, 128)
    assert not graphs.extends_prompt
    graphs.prefill_sizes = ()
    assert graphs.extends_prompt
