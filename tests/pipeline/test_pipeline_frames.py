"""Frame sets over time through the pipeline (issue 45 items 1, 2, 4): a query over K frame sets
(pipeline/frame_sets.py), each (camera, frame) view encoded once while it is in the feature
cache's window, temporal token selection, the time selection's upper bound, and the errors that
name the culprit. K = 1 is today's call, answer for answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import options, random_frames

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.pipeline.frame_sets import FrameSet
from litevlm_runtime.pipeline.pipeline import Pipeline, select_frames
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.stages.prompt import build_prompt, prompt_digest
from litevlm_runtime.stages.temporal import changed_tokens, token_change

QUESTION = "Is the car in front of the ego car moving?"


def moving_sets(n: int, seed: int = 0, still: tuple[str, ...] = ()) -> list[FrameSet]:
    """n frame sets of random frames, keyed by (camera, step); the cameras in `still` show the
    same image at every step (nothing changed there)."""
    base = random_frames(seed)
    out = []
    for t in range(n):
        frames = random_frames(seed * 100 + t + 1)
        images = {c: base[c] if c in still else frames[c] for c in CAMERAS}
        out.append(FrameSet(images, {c: (seed, c, t if c not in still else 0) for c in CAMERAS}))
    return out


@pytest.fixture(scope="module")
def pipe(tiny_model):
    return Pipeline.from_pretrained(tiny_model, options(max_new_tokens=3, temporal__mode="all"))


def test_one_frame_set_is_todays_call(pipe):
    """A camera -> image mapping and one FrameSet of it answer the same, as before frame sets."""
    images = random_frames(3)
    keys = {c: ("k", c) for c in CAMERAS}
    pipe.rt.features.clear()
    a = pipe.answer(images, QuestionOnce(QUESTION), frame_keys=keys)
    pipe.rt.features.clear()
    b = pipe.answer([FrameSet(images, keys)], QUESTION)
    assert (a.text, a.token_ids, a.prompt_sha256, a.input_tokens) == (b.text, b.token_ids, b.prompt_sha256,
                                                                      b.input_tokens)
    assert a.frames == 1 and a.kept_per_frame == [a.kept_tokens] and a.encoded_views == 6


def QuestionOnce(question):      # (a plain request; a name that says the first call encodes every view)
    return QueryRequest(question)


def test_k_frame_prompt_is_the_video_prompt_and_the_answer_says_what_it_cost(pipe):
    sets = moving_sets(4, seed=1)
    pipe.rt.features.clear()
    ans = pipe.answer(sets, QueryRequest(QUESTION, frames=4))
    rt = pipe.rt
    ids = build_prompt(rt.tok, rt.cfg.system_message, rt.prompt_layout, list(CAMERAS), QUESTION,
                       rt.tokens_per_camera, frames=4).input_ids
    assert ans.prompt_sha256 == prompt_digest(ids)
    assert ans.frames == 4 and ans.visual_tokens == 4 * 6 * rt.tokens_per_camera
    assert (ans.encoded_views, ans.reused_views) == (24, 0)
    assert len(ans.kept_per_frame) == 4 and sum(ans.kept_per_frame) == ans.kept_tokens
    # the same question again: every view from the cache
    again = pipe.answer(sets, QueryRequest(QUESTION, frames=4))
    assert (again.encoded_views, again.reused_views) == (0, 24) and again.text == ans.text


def test_a_sliding_window_encodes_only_the_new_frame_set(pipe):
    """The window moves by one frame set: only its six views are encoded, the 18 others come from
    the cache (sized max_frames x cameras at start-up, and one set more for the node's prefetching
    while idle: a query's views never evict each other)."""
    assert pipe.rt.arena.feature_cache.shape[0] == max(12, (4 + 1) * 6)
    sets = moving_sets(8, seed=2)
    pipe.rt.features.clear()
    first = pipe.answer(sets[:4], QueryRequest(QUESTION, frames=4))
    assert (first.encoded_views, first.reused_views) == (24, 0)
    for end in range(5, 9):
        ans = pipe.answer(sets[end - 4:end], QueryRequest(QUESTION, frames=4))
        assert (ans.encoded_views, ans.reused_views) == (6, 18)
        # the same answer as a cold run over the same sets (features reused are the features encoded)
        cold = Pipeline(pipe.rt)
        pipe.rt.features.clear()
        again = cold.answer(sets[end - 4:end], QueryRequest(QUESTION, frames=4))
        assert again.token_ids == ans.token_ids and again.prompt_sha256 == ans.prompt_sha256


def test_temporal_token_selection_drops_exactly_the_unchanged_tokens(tiny_model):
    """Older frame sets keep the tokens whose features changed by at least change_threshold against
    the newest set's at the same position (recomputed here in float64 from the cached features);
    a camera that did not change keeps none of its older tokens; threshold 0 keeps all."""
    still = ("CAM_BACK", "CAM_BACK_LEFT")
    sets = moving_sets(3, seed=4, still=still)
    for threshold in (0.0, 0.05, 0.3):
        p = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=2, temporal__mode="all",
                                                         temporal__change_threshold=threshold))
        ans = p.answer(sets, QueryRequest(QUESTION, frames=3))
        tpc = p.rt.tokens_per_camera
        expected = [0, 0, 0]
        for cam in CAMERAS:
            newest = p.rt.features.get(cam, sets[2].keys[cam]).double()
            expected[2] += tpc                        # (no token selector: the newest set keeps all)
            for t in range(2):
                older = p.rt.features.get(cam, sets[t].keys[cam]).double()
                change = (older - newest).norm(dim=-1) / newest.norm(dim=-1)
                expected[t] += int((change >= threshold).sum()) if threshold else tpc
                if cam in still:
                    assert float(change.max()) == 0.0
        assert ans.kept_per_frame == expected, threshold
        if threshold:
            assert ans.kept_per_frame[0] <= (6 - len(still)) * tpc
        assert ans.input_tokens == len(build_prompt(p.rt.tok, p.rt.cfg.system_message, p.rt.prompt_layout,
                                                    list(CAMERAS), QUESTION, tpc, frames=3).input_ids) \
            - (3 * 6 * tpc - sum(ans.kept_per_frame))


def test_token_change_is_the_relative_l2_distance():
    g = torch.Generator().manual_seed(0)
    newest = torch.randn(16, 8, generator=g, dtype=torch.float64)
    older = newest.clone()
    older[3] += 0.5
    older[7] *= 1.2
    d = token_change(older, newest)
    assert torch.allclose(d.double(), (older - newest).norm(dim=-1) / newest.norm(dim=-1), atol=1e-6)
    assert changed_tokens(older, newest, 0.1).tolist() == [3, 7]
    assert changed_tokens(older, newest, 0.0).tolist() == list(range(16))


def test_frames_is_the_upper_bound_and_mode_all_takes_every_set(tiny_model):
    """temporal.mode selector without a view selector: the time cue decides (a motion question gets
    every set asked for, a colour question the newest only); the request's frames bounds it."""
    p = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=2, temporal__mode="selector"))
    assert select_frames(p.rt, QUESTION, 4) == 4
    assert select_frames(p.rt, "What colour is the car in front of the ego car?", 4) == 1
    assert select_frames(p.rt, QUESTION, 2) == 2
    sets = moving_sets(4, seed=5)
    assert p.answer(sets, QueryRequest("What colour is the car in front?", frames=4)).frames == 1
    assert p.answer(sets, QueryRequest(QUESTION, frames=3)).frames == 3
    # the default request asks temporal.frames (1): the newest set of those given
    assert p.answer(sets, QueryRequest(QUESTION)).frames == 1


def test_bad_frame_sets_are_named(pipe):
    sets = moving_sets(4, seed=6)
    with pytest.raises(InputError, match="asks for 4 frame sets; 2 given"):
        pipe.answer(sets[:2], QueryRequest(QUESTION, frames=4))
    with pytest.raises(InputError, match=r"frames 5: must be from 1 to temporal.max_frames 4"):
        pipe.answer(sets, QueryRequest(QUESTION, frames=5))
    gap = list(sets)
    gap[1] = FrameSet({c: v for c, v in sets[1].images.items() if c != "CAM_BACK"}, sets[1].keys)
    with pytest.raises(InputError, match="no image for camera\\(s\\) CAM_BACK in frame set t-2") as e:
        pipe.answer(gap, QueryRequest(QUESTION, frames=4))
    assert e.value.camera == "CAM_BACK"
    with pytest.raises(InputError, match="FrameSet carries its own keys"):
        pipe.answer(sets, QueryRequest(QUESTION, frames=4), frame_keys={"CAM_FRONT": 1})


def test_sets_without_keys_are_encoded_for_the_query_alone(pipe):
    sets = [FrameSet(s.images) for s in moving_sets(4, seed=7)]
    a = pipe.answer(sets, QueryRequest(QUESTION, frames=4))
    b = pipe.answer(sets, QueryRequest(QUESTION, frames=4))
    assert (a.encoded_views, b.encoded_views) == (24, 24) and a.token_ids == b.token_ids


def test_feature_cache_off_still_holds_a_queries_window(tiny_model):
    p = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=2, temporal__mode="all",
                                                     serving__feature_cache=False))
    assert p.rt.arena.feature_cache.shape[0] == 24 and not p.rt.features.reuse
    sets = moving_sets(4, seed=8)
    a = p.answer(sets, QueryRequest(QUESTION, frames=4))
    b = p.answer(sets, QueryRequest(QUESTION, frames=4))
    assert (a.encoded_views, b.encoded_views, b.reused_views) == (24, 24, 0) and a.token_ids == b.token_ids
    one = Pipeline.from_pretrained(tiny_model, options(temporal__max_frames=1, serving__feature_cache=False))
    assert one.rt.features is None and one.rt.arena.feature_cache.shape[0] == 0


def test_arena_holds_max_frames_sets_of_prompt_rows(tiny_model):
    """The arena is sized once for temporal.max_frames: a prompt of max_frames sets with every
    token fits, and the option's bounds are named."""
    p = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=2, temporal__mode="all",
                                                     temporal__max_frames=3, pipeline="baseline"))
    tpc = p.rt.tokens_per_camera
    assert p.rt.arena.max_visual == 3 * 6 * tpc
    ans = p.answer(moving_sets(3, seed=9), QueryRequest(QUESTION, frames=3))
    assert ans.frames == 3
    with pytest.raises(InputError, match="temporal.frames: 4 is above temporal.max_frames 3"):
        options(temporal__frames=4, temporal__max_frames=3)


def test_follow_up_of_a_k_frame_answer_continues_its_conversation(pipe):
    sets = moving_sets(4, seed=10)
    first = pipe.answer(sets, QueryRequest(QUESTION, frames=4, query_id="m1", keep_turn=True))
    follow = pipe.answer(sets[-1:], QueryRequest("And is it turning?", follow_up_of="m1"))
    assert follow.frames == 4 and follow.reused_tokens > 0 and follow.cameras == first.cameras
    ref = pipe.answer(sets, QueryRequest("And is it turning?", frames=4, history=((QUESTION, first.text),)))
    assert follow.token_ids == ref.token_ids


def test_prefetched_views_serve_a_k_frame_query(pipe):
    sets = moving_sets(4, seed=11)
    pipe.rt.features.clear()
    for s in sets[:3]:
        pipe.prefetch(s.images, s.keys)
    ans = pipe.answer(sets, QueryRequest(QUESTION, frames=4))
    assert (ans.encoded_views, ans.reused_views) == (6, 18)
    assert np.isfinite(ans.total_ms)


def test_a_latency_budget_answers_from_the_newest_set(pipe):
    """The budget planner's cost model is one frame set's: under a budget a K-frame question is
    planned on the newest set, and the Answer says so."""
    sets = moving_sets(4, seed=12)
    ans = pipe.answer(sets, QueryRequest(QUESTION, frames=4, budget_ms=60_000.0))
    assert ans.frames == 1 and ans.degraded[0] == "frames 4->1" and ans.encoded_views + ans.reused_views == 6


def test_stages_timed_in_several_calls_add_up():
    """A K-frame query's vision runs one frame set's tiles per call: its stage time is their sum."""
    from litevlm_runtime.timing import StageTimer

    timer = StageTimer(torch.device("cpu"))
    for stage in ("view_select", "vision", "prefill", "vision"):
        with timer(stage):
            pass
    with timer("vision", idle=True):
        pass
    ms = timer.milliseconds()
    assert list(ms) == ["view_select", "vision", "prefill"]
    marks = [(s, a, b) for s, a, b in timer._marks if s == "vision" and a is not None]
    assert ms["vision"] == pytest.approx(sum((b - a) * 1000.0 for _, a, b in marks))
