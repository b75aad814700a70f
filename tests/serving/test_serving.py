"""Serving a driving stack: visual reuse across questions on one frame set (answers identical to a
run without reuse), and latency budgets (a plan that fits, says what it degraded, and degrades
nothing when the budget is loose), on the bundled model's deployed LiteVLM configuration."""

import pytest
from helpers import options, random_frames

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest

QUESTIONS = ["What is in front of the ego vehicle?", "Is there a pedestrian behind the ego car?",
             "What should the ego vehicle do next?", "Are there cars on the front left?"]


@pytest.fixture(scope="module")
def frames():
    return [random_frames(s, 270, 480) for s in (1, 2)]


@pytest.fixture(scope="module")
def reuse():
    return Pipeline.from_pretrained(DEFAULT_MODEL, options())


@pytest.fixture(scope="module")
def no_reuse():
    return Pipeline.from_pretrained(DEFAULT_MODEL, options(serving__feature_cache=False))


def test_later_questions_reuse_the_frame_sets_features(reuse, no_reuse, frames):
    # (serving.feature_cache off keeps the region of a K-frame query's window, never found again)
    assert not no_reuse.rt.features.reuse and no_reuse.rt.arena.feature_cache.shape[0] == 4 * 6
    for i, images in enumerate(frames):
        keys = {c: ("set", i) for c in images}
        seen: set[str] = set()
        for q in QUESTIONS:
            a = reuse.answer(images, q, frame_keys=keys)
            b = no_reuse.answer(images, q, frame_keys=keys)
            assert a.token_ids == b.token_ids and a.cameras == b.cameras, q
            assert set(a.reused_cameras) == set(a.cameras) & seen      # every camera seen before is reused
            assert b.reused_cameras == []
            if set(a.cameras) <= seen:
                assert a.stage_ms["vision"] < b.stage_ms["vision"]   # nothing left to encode
            seen |= set(a.cameras)
    # without frame keys nothing is reused (the caller did not say the frames are the same)
    assert reuse.answer(frames[0], QUESTIONS[0]).reused_cameras == []


def test_the_cache_is_a_fixed_arena_region_evicting_the_oldest(frames):
    # (temporal.max_frames 1: no window of frame sets over time to hold, the configured 2 slots alone)
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(serving__feature_cache_cameras=2, views__mode="all",
                                                           temporal__max_frames=1))
    region = pipe.rt.arena.feature_cache
    ptr = region.data_ptr()
    pipe.answer(frames[0], QUESTIONS[0], frame_keys={c: "a" for c in frames[0]})
    assert len(pipe.rt.features.index) == 2                       # six cameras encoded, two kept
    assert set(pipe.rt.features.index) == {("CAM_BACK_LEFT", "a"), ("CAM_BACK_RIGHT", "a")}   # the newest
    again = pipe.answer(frames[0], QUESTIONS[1], frame_keys={c: "a" for c in frames[0]})
    assert set(again.reused_cameras) == {"CAM_BACK_LEFT", "CAM_BACK_RIGHT"}
    assert pipe.rt.arena.feature_cache.data_ptr() == ptr and region.shape[0] == 2


def test_a_loose_budget_changes_nothing(reuse, frames):
    free = reuse.answer(frames[0], QUESTIONS[2])
    loose = reuse.answer(frames[0], QueryRequest(QUESTIONS[2], budget_ms=1e6))
    assert loose.token_ids == free.token_ids and loose.degraded == [] and loose.budget_met


def test_a_tight_budget_degrades_in_order_and_says_so(frames):
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options())
    pipe.warm_up()
    unbudgeted = [pipe.answer(frames[0], q) for q in QUESTIONS]
    budget = sorted(a.total_ms for a in unbudgeted)[len(unbudgeted) // 2] / 2
    for q, free in zip(QUESTIONS, unbudgeted):
        a = pipe.answer(frames[0], QueryRequest(q, budget_ms=budget))
        assert a.budget_ms == budget and a.token_ids
        if a.degraded:
            cut = " ".join(a.degraded)
            assert any(k in cut for k in ("views", "tokens", "answer cut", "cannot be met")), a.degraded
            if "views" in cut:
                assert set(a.cameras) < set(free.cameras)               # a subset, never new cameras
            if "answer cut" in cut:
                assert len(a.token_ids) == int(cut.split("answer cut at ")[1].split()[0])
                assert a.token_ids == free.token_ids[:len(a.token_ids)] or "views" in cut or "tokens" in cut
    impossible = pipe.answer(frames[0], QueryRequest(QUESTIONS[2], budget_ms=0.001))
    assert impossible.token_ids and not impossible.budget_met
    assert any("cannot be met" in d for d in impossible.degraded) and len(impossible.cameras) == 1


def test_a_planner_never_warmed_up_learns_from_its_first_answer(reuse, frames):
    """Without warm-up measurements the cost model starts empty: its first answer sets the
    prefill level (not zero forever), and a decoding mode not seen yet is priced as the one seen,
    not as free (the planner then predicts a prompt and a token, never a fraction of a ms)."""
    from litevlm_runtime.stages.budget import StageCosts

    costs = StageCosts()
    answer = reuse.answer(frames[1], QUESTIONS[0])
    mode = "eagle" if reuse.rt.draft is not None else "greedy"
    costs.observe(answer, len(answer.cameras), mode)
    assert costs.prefill_base == answer.stage_ms["prefill"] > 0 and costs.prefill_per_row == 0
    assert costs.token_ms("greedy") == costs.token_ms("eagle") == costs.per_token[mode] > 0
    assert StageCosts().token_ms("greedy") == 1e-3                 # nothing seen at all


def test_a_follow_ups_plan_does_not_price_a_view_selection(reuse):
    """A follow-up keeps its conversation's views and runs no view selector: its predicted cost is
    the first question's plan's over the same rows, less the selector's measured cost."""
    planner = reuse.rt.planner
    saved = planner.costs.view_select
    try:
        planner.costs.view_select = 7.0
        cams = list(reuse.rt.options.cameras[:2])
        first = planner.plan(1e6, cams, set(cams), 1.0, "greedy", 8, 100)
        follow_up = planner.plan(1e6, cams, set(cams), 1.0, "greedy", 8, 100 + 2 * reuse.rt.tokens_per_camera,
                                 fixed_views=True)
        assert first.predicted_ms - follow_up.predicted_ms == pytest.approx(7.0)
    finally:
        planner.costs.view_select = saved


def test_idle_prefetch_encodes_the_rest_of_the_frame_set(frames):
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options())
    keys = {c: "p" for c in frames[0]}
    first = pipe.answer(frames[0], "What is in front of the ego vehicle?", frame_keys=keys)
    encoded = pipe.prefetch(frames[0], keys)
    assert set(encoded) == set(frames[0]) - set(first.cameras)
    later = pipe.answer(frames[0], "Predict the behavior of the ego vehicle.", frame_keys=keys)
    assert set(later.reused_cameras) == set(later.cameras)
    assert pipe.prefetch(frames[0], keys) == [] and pipe.prefetch(frames[1], keys, stop=lambda: True) == []
