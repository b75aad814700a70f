"""Query priority (Query.priority): the request queue admits by priority then arrival, and the
batch decoder schedules by it: a high-priority query that finds every batch region taken by
lower-priority ones preempts one after the current pass, so a burst of low-priority questions
delays it by at most one running step. The preempted query runs again from its start later and
gets the answer it would have had (greedy: the same tokens), and every query one record."""

from __future__ import annotations

import pytest
from helpers import options
from helpers.ros import jpeg

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.serving.batch_worker import BatchWorker
from litevlm_runtime.serving.frame_store import Frame
from litevlm_runtime.serving.images import CompressedPayload
from litevlm_runtime.serving.queue import Queued, RequestQueue
from litevlm_runtime.serving.server import GC_CLOCK, QueryServer
from litevlm_runtime.serving.settings import ServerSettings

MS = 1_000_000
QUESTIONS = ["What is in front of the ego car?", "Is there a truck behind?", "What should the ego vehicle do?",
             "Are there pedestrians on the left?", "Describe the scene.", "Is the road wet?"]


def queued(priority: int, qid: str) -> Queued:
    return Queued(QueryRequest("q?", query_id=qid, priority=priority), received_ns=0)


def test_the_queue_serves_priority_then_arrival_and_makes_room_for_a_higher_one():
    q = RequestQueue(3, "reject_new")
    for item in (queued(0, "a"), queued(0, "b"), queued(2, "c")):
        assert q.put(item) is None
    assert q.first_priority() == 2
    refused = q.put(queued(1, "d"))              # full: the newest of the lowest priority makes room
    assert refused.query_id == "b"
    assert q.put(queued(0, "e")).query_id == "e"   # not above the lowest: reject_new refuses it
    assert [q.get(timeout=0).query_id for _ in range(3)] == ["c", "d", "a"]
    drop = RequestQueue(2, "drop_oldest")
    drop.put(queued(0, "x")), drop.put(queued(0, "y"))
    assert drop.put(queued(0, "z")).query_id == "x"           # drop_oldest, among the lowest
    back = queued(0, "x")
    drop.put_back(back)                                       # a preempted one: back in its place, over size
    assert [r.query_id for r in drop.drain()] == ["x", "y", "z"] or len(drop) == 0


def test_priority_out_of_range_is_a_bad_question(tiny_model):
    pipe = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=2))
    with pytest.raises(InputError, match="priority 300"):
        QueryRequest("q?", priority=300).checked(pipe.rt)


@pytest.fixture(scope="module")
def pipe(tiny_model):
    return Pipeline.from_pretrained(tiny_model, options(max_new_tokens=12, decoding__mode="greedy",
                                                        serving__max_batch=2, serving__feature_cache=False))


def test_a_high_priority_query_waits_at_most_one_running_step(pipe):
    images = {c: jpeg(30 + i) for i, c in enumerate(CAMERAS)}
    records = []
    server = QueryServer(ServerSettings(queue_size=16, match_wait_s=0.0), records.append, clock_ns=lambda: 10 * MS)
    server.load(lambda: pipe, warmup=False)
    server.active = True
    for cam in CAMERAS:
        server.frames.add(Frame(cam, 5 * MS, CompressedPayload("jpeg", images[cam])), now_ns=5 * MS)
    worker = BatchWorker(server, GC_CLOCK)
    steps = []
    real_step = worker.batch.step
    worker.batch.step = lambda waiting=lambda: False: (steps.append([r.tag[0].query_id for r in worker.batch.running]),
                                                       real_step(waiting))[1]
    for i, q in enumerate(QUESTIONS):                         # the burst, low priority
        assert server.submit(QueryRequest(q, query_id=f"low{i}", stamp_ns=10 * MS)) is not None
    worker.tick(timeout=0)
    worker.tick(timeout=0)
    assert len(steps) == 2 and len(worker.batch.running) == 2    # both regions taken by the burst
    assert server.submit(QueryRequest(QUESTIONS[0], query_id="high", priority=9, stamp_ns=10 * MS)) is not None
    worker.tick(timeout=0)                                    # the next pass: it runs in it
    assert "high" in steps[-1], steps[-1]
    while len(worker.batch) or len(server.queue):
        worker.tick(timeout=0)
    order = [r.query_id for r in records]
    assert sorted(order) == sorted([f"low{i}" for i in range(len(QUESTIONS))] + ["high"])    # one record each
    assert all(r.status == "ok" for r in records), [(r.query_id, r.status_message) for r in records]
    assert order.index("high") < 2, order                     # ahead of the queued burst
    by_id = {r.query_id: r for r in records}
    for i, q in enumerate(QUESTIONS):                          # the preempted one too: same answer as alone
        assert by_id[f"low{i}"].token_ids == pipe.answer(images, q).token_ids, i
    assert by_id["high"].token_ids == pipe.answer(images, QUESTIONS[0]).token_ids
