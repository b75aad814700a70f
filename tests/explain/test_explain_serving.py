"""Explanations where queries are served (issue 33 phase 2): computed only when asked (the request's
flag, the server's `explain` setting, a subscriber), off the query's path otherwise; the trace of a
batched query taken at its admission (the next admission overwrites the arena's prompt rows); the
explanation handed on after the answer's record; and the objects of every answer as data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import options
from helpers.explain import jpeg_frames

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import LiteVLMError
from litevlm_runtime.objects import parse_objects
from litevlm_runtime.pipeline import pipeline as pipeline_module
from litevlm_runtime.pipeline.batching import BatchDecoder
from litevlm_runtime.pipeline.explanation import explain, trace_from_arena
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.serving.explainer import Explainer
from litevlm_runtime.serving.frame_store import Frame
from litevlm_runtime.serving.images import CompressedPayload
from litevlm_runtime.serving.server import QueryServer
from litevlm_runtime.serving.settings import ServerSettings

MS = 1_000_000
QUESTIONS = ("What is behind the ego car?", "Is there a car to the front left of <c1,CAM_FRONT_LEFT,805.5,430.0>?",
             "What is the status of <c2,CAM_BACK,1000.0,500.0> and <c9,CAM_BAK,1,2>?")


@pytest.fixture(scope="module")
def pipe(tiny_model):
    """The tiny model with three KV regions, layer-0 token selection at r = 0.5, greedy."""
    return Pipeline.from_pretrained(tiny_model, options(serving__max_batch=3, max_new_tokens=6, tokens__mode="layer0",
                                                        tokens__keep_ratio=0.5, decoding__mode="greedy"))


def test_a_query_not_asked_to_explain_runs_no_explanation_code(pipe, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("prompt_trace ran for a query that did not ask")

    frames = jpeg_frames(1)
    plain = pipe.answer(frames, QUESTIONS[1])
    monkeypatch.setattr(pipeline_module, "prompt_trace", refuse)
    again = pipe.answer(frames, QUESTIONS[1])
    assert again.trace is None and again.token_ids == plain.token_ids
    with pytest.raises(AssertionError, match="did not ask"):        # (the patch is where the pipeline calls it)
        pipe.answer(frames, QueryRequest(QUESTIONS[1], explain=True))


def test_every_answer_carries_its_objects(pipe):
    frames = jpeg_frames(1)
    for question in QUESTIONS:
        ans = pipe.answer(frames, question)
        assert ans.question_objects == list(parse_objects(question).objects)
        assert ans.objects == list(parse_objects(ans.text).objects)
    assert [o.object_id for o in ans.question_objects] == ["c2"]
    assert ans.malformed_tags == ["question '<c9,CAM_BAK,1,2>': unknown camera CAM_BAK (the rig: "
                                  + ", ".join(CAMERAS) + ")"]
    d = ans.to_dict()
    assert "trace" not in d and d["question_objects"][0]["camera"] == "CAM_BACK"


def test_batched_queries_are_explained_from_their_own_prompts(pipe):
    """Three queries admitted one after the other into one batch: each answer's trace is its own
    prompt's (equal to the trace of the same query answered alone), though the arena holds only the
    last admitted prompt by the time they finish."""
    frames = [jpeg_frames(1), jpeg_frames(2)]
    batch = BatchDecoder(pipe)
    for i, question in enumerate(QUESTIONS):
        batch.admit(frames[i % 2], QueryRequest(question, explain=True), tag=question)
    answers = {r.tag: ans for r, ans in batch.run()}
    assert sum(a.batched_steps > 0 for a in answers.values()) >= 2
    with pytest.raises(LiteVLMError, match="no longer holds"):
        trace_from_arena(pipe.rt, answers[QUESTIONS[0]])             # reading the arena afterwards would be wrong
    for i, question in enumerate(QUESTIONS):
        batched, alone = answers[question], pipe.answer(frames[i % 2], QueryRequest(question, explain=True))
        assert batched.token_ids == alone.token_ids
        a, b = batched.trace, alone.trace
        assert a.question == question and a.answer == batched.text and a.answer_ids == tuple(batched.token_ids)
        assert torch.equal(a.prompt_embeds, b.prompt_embeds) and torch.equal(a.rows, b.rows)
        assert all(torch.equal(x, y) for x, y in zip(a.keep, b.keep)) and a.cameras == b.cameras
        ea, eb = explain(pipe.rt, a), explain(pipe.rt, b)
        for va, vb in zip(ea.views, eb.views):
            if va.selected:
                np.testing.assert_allclose(va.attention, vb.attention, rtol=0, atol=1e-6)
                np.testing.assert_array_equal(va.kept, vb.kept)


def _server(pipe, mode: str, subscribed: list, events: list, threaded: bool = False):
    def publish_record(rec):
        events.append(("answer", rec.query_id, rec.trace))

    def publish_explanation(done):
        events.append(("explanation", done.record.query_id, done))

    explainer = Explainer(publish_explanation, threaded=threaded, width=720)
    server = QueryServer(ServerSettings(match_wait_s=0.0, explain=mode), publish_record, clock_ns=lambda: 0,
                         explainer=explainer, explanation_subscribed=lambda: subscribed[0])
    server.load(lambda: pipe, warmup=False)
    server.active = True
    frames = jpeg_frames(3)
    for cam in CAMERAS:
        server.frames.add(Frame(cam, 1000 * MS, CompressedPayload("jpeg", frames[cam])), now_ns=1000 * MS)
    return server


def _ask(server, query_id: str, explain: bool = False):
    req = server.submit(QueryRequest(QUESTIONS[1], query_id=query_id, stamp_ns=1100 * MS, explain=explain),
                        now_ns=1100 * MS)
    return req, server.serve(req, now_ns=1150 * MS)


@pytest.mark.parametrize("mode, subscribed, flag, explained", [
    ("never", True, True, False),           # never: nothing, a query's flag included
    ("subscribed", False, False, False),    # the default with nobody listening: nothing
    ("subscribed", True, False, True),      # ... with a subscriber: every query
    ("subscribed", False, True, True),      # ... or a query that asks
    ("always", False, False, True),
])
def test_which_queries_the_server_explains(pipe, mode, subscribed, flag, explained):
    events = []
    server = _server(pipe, mode, [subscribed], events)
    req, rec = _ask(server, "q1", flag)
    assert rec.status == "ok" and req.request.explain is explained
    assert events[0][:2] == ("answer", "q1") and events[0][2] is None       # the record published carries no trace
    if not explained:
        assert len(events) == 1 and server.explainer.explained == 0
        return
    kind, query_id, done = events[1]                                        # after the answer's record
    assert (kind, query_id, len(events)) == ("explanation", "q1", 2)
    assert done.record is rec and done.explanation.answer == rec.text and done.picture[:3] == b"\xff\xd8\xff"
    assert set(done.cost_ms) == {"views", "token_scores", "attention", "draw", "jpeg"}
    assert server.stats()["explanations"]["explained"] == 1


def test_the_explainer_thread_publishes_after_the_answer_and_stops_cleanly(pipe):
    events = []
    server = _server(pipe, "always", [False], events, threaded=True)
    server.explainer.start()
    try:
        for i in range(3):
            _ask(server, f"t{i}")
        server.explainer.stop(timeout_s=120)
    finally:
        server.explainer.stop(timeout_s=0)
    answers = [e[1] for e in events if e[0] == "answer"]
    explained = [e[1] for e in events if e[0] == "explanation"]
    assert answers == ["t0", "t1", "t2"] and sorted(explained) == answers
    for query_id in answers:       # each explanation after its own answer
        assert events.index(("answer", query_id, None)) < [e[1] if e[0] == "explanation" else None
                                                           for e in events].index(query_id)
    assert server.explainer.stats()["dropped"] == 0


def test_a_full_explainer_queue_drops_the_oldest_explanation_not_an_answer(pipe):
    events = []
    server = _server(pipe, "always", [False], events, threaded=True)
    server.explainer.depth = 1                  # (not started: nothing is taken from its queue)
    for i in range(3):
        _, rec = _ask(server, f"d{i}")
        assert rec.status == "ok"
    assert [e[1] for e in events] == ["d0", "d1", "d2"] and server.explainer.dropped == 2
    server.explainer.start()
    server.explainer.stop(timeout_s=120)
    assert [e[1] for e in events if e[0] == "explanation"] == ["d2"]
