"""The explanation of an answer (pipeline/explanation.py): its attention pass and token scores proved
against transformers' own decoder in float64, the token grid against the model's pixel shuffle, and
bad or stale traces refused by name."""

from __future__ import annotations

from dataclasses import replace

import helpers.explain as explain_fixtures
import numpy as np
import pytest
import torch
from helpers import random_frames

from litevlm_runtime.bench.hf_reference import build_hf_text_model, load_upstream_state_dict
from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError, LiteVLMError
from litevlm_runtime.models.projector import pixel_shuffle
from litevlm_runtime.pipeline.explanation import TokenGrid, attention_layers, explain, trace_from_arena
from litevlm_runtime.stages.token_selector import kept_count

QUESTION = explain_fixtures.QUESTION
explained = explain_fixtures.explained      # the module fixture both explanation test files use
# float32 probabilities (~5e-3 each here) against float64 ones: measured 1e-9; a wrong position id moves them 1.5e-4
TOL = 1e-7


def _reference(tiny_model):
    config, state = load_upstream_state_dict(tiny_model)
    return build_hf_text_model(config, state).double()


def test_attention_pass_matches_transformers_in_float64(tiny_model, explained):
    pipe, answer, trace, e, _ = explained
    assert answer.token_ids and len(trace.rows) == answer.input_tokens
    ref = _reference(tiny_model)
    n, fed = len(trace.rows), answer.token_ids[:-1]
    with torch.no_grad():
        embeds = torch.cat([trace.prompt_embeds.double()[trace.rows],
                            ref.get_input_embeddings()(torch.tensor(fed, dtype=torch.long))])
        positions = torch.cat([trace.rows, trace.layout.length + torch.arange(len(fed))])
        out = ref(inputs_embeds=embeds[None], position_ids=positions[None], output_attentions=True)
    rows = torch.arange(n - 1, n + len(fed))                            # each chose one answer token
    mean = torch.stack([out.attentions[i][0][:, rows] for i in (0, 1)]).mean((0, 1, 2))   # layers, heads, rows
    assert e.attention_rows == len(answer.token_ids) and e.attention_layers == (0, 1)
    for cam, (start, count), kept in zip(trace.cameras, trace.layout.spans, trace.keep):
        view = e.view(cam)
        expected = np.zeros(count)
        at = {int(r): i for i, r in enumerate(trace.rows)}
        for k in kept.tolist():
            expected[k] = float(mean[at[start + k]])
        assert view.attention.shape == (count,) and not view.attention[~view.kept].any()
        np.testing.assert_allclose(view.attention, expected, atol=TOL, rtol=0)
    visual = sum(float(e.view(c).attention.sum()) for c in trace.cameras)
    assert e.visual_share == pytest.approx(visual) and 0 < e.visual_share < 1


def test_token_scores_match_transformers_layer0_and_reproduce_the_kept_tokens(tiny_model, explained):
    pipe, answer, trace, e, _ = explained
    ref = _reference(tiny_model)
    q0, q1 = trace.layout.question
    with torch.no_grad():
        out = ref(inputs_embeds=trace.prompt_embeds.double()[None], output_attentions=True)
    probs = out.attentions[0][0].mean(0)[q0:q1]                          # [question rows, L], mean over heads
    for cam, (start, count), kept in zip(trace.cameras, trace.layout.spans, trace.keep):
        view = e.view(cam)
        expected = probs[:, start:start + count].max(0).values.numpy()   # the selector's default: max over the question
        np.testing.assert_allclose(view.token_scores, expected, atol=TOL, rtol=0)
        top = set(np.argsort(-expected)[:kept_count(count, 0.5)].tolist())
        assert set(np.flatnonzero(view.kept).tolist()) == top == set(kept.tolist())
    assert sum(int(e.view(c).kept.sum()) for c in trace.cameras) == answer.kept_tokens


def test_views_and_objects_of_the_explanation(explained):
    pipe, answer, trace, e, _ = explained
    assert [v.camera for v in e.views] == list(CAMERAS)
    assert e.cameras == answer.cameras and set(answer.cameras) >= {"CAM_FRONT_LEFT", "CAM_BACK"}
    assert len(answer.cameras) < len(CAMERAS)
    selection = pipe.rt.view_selector.explain(QUESTION)
    for v in e.views:
        assert v.selected == (v.camera in answer.cameras)
        assert (v.attention is None) == (v.kept is None) == (not v.selected)
        assert (v.view_probability, v.view_score) == (selection.module[v.camera], selection.scores[v.camera])
    (obj,) = e.question_objects
    assert (obj.object_id, obj.camera, obj.x, obj.y) == ("c1", "CAM_FRONT_LEFT", 805.5, 430.0)
    d = e.to_dict()
    assert d["cameras"] == answer.cameras and d["question_objects"][0]["object_id"] == "c1"
    assert set(e.cost_ms) == {"views", "token_scores", "attention"}


def test_token_grid_follows_the_pixel_shuffle():
    """Token i of a tile merges the 2 x 2 patches at (2 row, 2 col) of the patch grid (patches
    flattened row-major, as the patch embedding's conv output is), proved with the model's own
    pixel_shuffle; and the boxes of two tiles cover the squashed image left to right."""
    side_patches = 8
    patch_ids = torch.arange(side_patches * side_patches, dtype=torch.float64)
    shuffled = pixel_shuffle(patch_ids.view(1, side_patches, side_patches, 1), 0.5)   # [1, 4, 4, 4]
    tokens = shuffled.reshape(-1, 4)                                                  # as vit_to_visual_tokens
    grid = TokenGrid(tiles=1, side=4, tile_px=112)
    for i, merged in enumerate(tokens.tolist()):
        row, col = (i % 16) // 4, i % 4
        expected = {(2 * row + dr) * side_patches + 2 * col + dc for dr in (0, 1) for dc in (0, 1)}
        assert set(int(p) for p in merged) == expected
    boxes = TokenGrid(tiles=2, side=4, tile_px=112).boxes(1600, 900)
    assert boxes.shape == (32, 4)
    np.testing.assert_allclose(boxes[0], [0, 0, 200, 225])
    np.testing.assert_allclose(boxes[5], [200, 225, 400, 450])       # tile 0, row 1, column 1
    np.testing.assert_allclose(boxes[16], [800, 0, 1000, 225])       # tile 1 starts at the image's middle
    np.testing.assert_allclose(boxes[31], [1400, 675, 1600, 900])
    assert grid.image(np.arange(16)).tolist() == np.arange(16).reshape(4, 4).tolist()


def test_attention_layers_are_the_middle_half():
    assert attention_layers(12) == (3, 4, 5, 6, 7, 8) and attention_layers(24) == tuple(range(6, 18))
    assert attention_layers(2) == (0, 1) and attention_layers(1) == (0,) and attention_layers(4) == (1, 2)


def test_a_stale_or_foreign_trace_is_refused_by_name(explained):
    pipe, answer, trace, e, _ = explained
    with pytest.raises(InputError, match="layers"):
        explain(pipe.rt, trace, layers=(5,))
    with pytest.raises(InputError, match="prompt_embeds"):
        explain(pipe.rt, replace(trace, prompt_embeds=trace.prompt_embeds[:-1]))
    with pytest.raises(InputError, match="answer token"):
        explain(pipe.rt, replace(trace, answer_ids=(10 ** 6,)))
    with pytest.raises(InputError, match="rows"):
        explain(pipe.rt, replace(trace, rows=trace.rows.flip(0)))
    other = pipe.answer(random_frames(2), "What is behind the ego car?")
    with pytest.raises(LiteVLMError, match="no longer holds"):
        trace_from_arena(pipe.rt, answer)                 # another query ran since
    assert trace_from_arena(pipe.rt, other).question == other.question
