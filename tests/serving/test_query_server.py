"""The node's query server without ROS: every query gets exactly one record, with the right
status, and accepted queries give what the pipeline itself gives. Uses the real tiny pipeline."""

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.serving.frame_store import Frame
from litevlm_runtime.serving.images import CompressedPayload, RawPayload
from litevlm_runtime.serving.server import QueryServer
from litevlm_runtime.serving.settings import ServerSettings

MS = 1_000_000


def jpeg(seed: int, size=(160, 90)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pipeline(tiny_model):
    return Pipeline.from_pretrained(tiny_model, PipelineOptions(max_new_tokens=3))      # tiny: the baseline


def make_server(pipeline, clock_ns=lambda: 0, publish_partial=None, **kw):
    """A server over `pipeline`; a failed frame match is refused at once unless a test asks for
    match_wait_s (the shipped default waits for frames still in flight)."""
    records = []
    server = QueryServer(
        ServerSettings(**{"match_wait_s": 0.0, **kw}),
        records.append,
        clock_ns=clock_ns,
        publish_partial=publish_partial,
    )
    if pipeline is not None:
        server.load(lambda: pipeline, warmup=False)
        server.active = True
    return server, records


def add_frames(server, t, payloads=None):
    for cam in CAMERAS:
        server.frames.add(
            Frame(cam, t, (payloads or {}).get(cam) or CompressedPayload("jpeg", jpeg(CAMERAS.index(cam)))), now_ns=t
        )     # arriving as stamped (the server's clock is fixed at 0 here)


def test_answer_is_what_the_pipeline_gives(pipeline):
    server, records = make_server(pipeline)
    add_frames(server, 1000 * MS)
    req = server.submit(QueryRequest("What is in front?", query_id="a", stamp_ns=1100 * MS), now_ns=1100 * MS)
    assert req is not None and not records
    rec = server.serve(req, now_ns=1150 * MS)
    direct = pipeline.answer({c: jpeg(CAMERAS.index(c)) for c in CAMERAS}, "What is in front?")
    assert rec.status == "ok" and records == [rec]
    assert rec.token_ids == direct.token_ids and rec.text == direct.text
    assert list(rec.stage_ms) == list(direct.stage_ms) and all(
        v > 0 for k, v in rec.stage_ms.items() if k != "view_select"
    )
    assert rec.queue_ms == pytest.approx(50.0)
    assert rec.frame_stamps_ns == {c: 1000 * MS for c in CAMERAS}
    assert rec.to_json()["frame_offsets_ms"]["CAM_FRONT"] == pytest.approx(-100.0)


def test_raw_bgr_frames_are_converted(pipeline):
    server, records = make_server(pipeline)
    rgb = np.asarray(Image.open(io.BytesIO(jpeg(1))).convert("RGB"))
    bgr = RawPayload("bgr8", rgb.shape[0], rgb.shape[1], rgb.shape[1] * 3, rgb[:, :, ::-1].tobytes())
    add_frames(server, 0, {c: bgr for c in CAMERAS})
    rec = server.serve(server.submit(QueryRequest("front?"), now_ns=10 * MS), now_ns=10 * MS)
    direct = pipeline.answer({c: rgb for c in CAMERAS}, "front?")
    assert rec.status == "ok" and rec.token_ids == direct.token_ids


def test_bad_questions(pipeline):
    server, records = make_server(pipeline, max_question_chars=50)
    add_frames(server, 0)
    assert server.submit(QueryRequest("   "), now_ns=1) is None
    assert server.submit(QueryRequest("x" * 51), now_ns=1) is None
    assert server.submit(QueryRequest("what is <img> here?"), now_ns=1) is None  # a reserved token: refused on arrival
    assert server.submit(QueryRequest("\u200b\u200b\u200b"), now_ns=1) is None      # zero-width spaces only
    assert server.submit(QueryRequest("\u2060\ufeff\u200d \u00ad\n"), now_ns=1) is None   # joiners, BOM, soft hyphen
    assert [r.status for r in records] == ["bad_question"] * 5
    assert "empty" in records[0].status_message and "51" in records[1].status_message
    assert "<img>" in records[2].status_message
    assert all("invisible" in r.status_message for r in records[3:])
    assert len({r.query_id for r in records}) == 5
    # A question that is visible text around invisible characters is a question.
    assert server.submit(QueryRequest("front\u200b?"), now_ns=1) is not None


def test_undecodable_image_names_the_camera(pipeline):
    server, records = make_server(pipeline)
    truncated = jpeg(3)[:200]                                     # JPEG signature, broken body
    add_frames(server, 0, {"CAM_BACK": CompressedPayload("jpeg", truncated)})
    server.serve(server.submit(QueryRequest("anything behind?"), now_ns=1), now_ns=1)
    add_frames(server, 0, {"CAM_BACK_LEFT": CompressedPayload("jpeg", b"GIF89a....")})
    server.serve(server.submit(QueryRequest("anything behind?"), now_ns=2), now_ns=2)
    assert [r.status for r in records] == ["bad_image", "bad_image"]
    assert records[0].status_message.startswith("CAM_BACK") and "CAM_BACK_LEFT" in records[1].status_message
    add_frames(server, 5 * MS)                                    # good frames again: serving resumes
    assert server.serve(server.submit(QueryRequest("and now?"), now_ns=6 * MS), now_ns=6 * MS).status == "ok"


def test_deadline_checked_on_arrival_and_before_running(pipeline):
    server, records = make_server(pipeline)
    add_frames(server, 0)
    assert server.submit(QueryRequest("late?", deadline_ns=5 * MS), now_ns=10 * MS) is None
    req = server.submit(QueryRequest("in time?", deadline_ns=50 * MS), now_ns=10 * MS)
    server.serve(req, now_ns=60 * MS)                            # waited in the queue past it
    assert [r.status for r in records] == ["deadline_passed", "deadline_passed"]
    assert "queue" in records[1].status_message


@pytest.mark.parametrize(
    "policy, refused, kept", [("reject_new", "q3", ["q1", "q2"]), ("drop_oldest", "q1", ["q2", "q3"])]
)
def test_queue_overflow_policy(pipeline, policy, refused, kept):
    server, records = make_server(pipeline, queue_size=2, overflow_policy=policy)
    add_frames(server, 0)
    for i in (1, 2, 3):
        server.submit(QueryRequest(f"question {i}", query_id=f"q{i}"), now_ns=1)
    assert [(r.query_id, r.status) for r in records] == [(refused, "queue_full")]
    assert [r.query_id for r in server.queue.drain()] == kept


def test_not_active_and_failed_model(tmp_path, pipeline):
    server, records = make_server(None)
    server.submit(QueryRequest("hello?"), now_ns=1)
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text("{\"vision_config\": {}}")
    with pytest.raises(Exception):
        server.load(lambda: Pipeline.from_pretrained(bad, PipelineOptions()), warmup=False)
    server.submit(QueryRequest("hello again?"), now_ns=2)
    assert [r.status for r in records] == ["not_active", "pipeline_error"]
    assert "model not loaded" in records[1].status_message and server.stats()["errors"] == 2


def test_pipeline_failure_mid_run_is_answered_and_serving_continues(tiny_model):
    # A real pipeline with one weight damaged after loading (a fault, not a stand-in): answer()
    # raises a shape error inside the model; the server answers pipeline_error, and serves again
    # once the weight is repaired.
    import torch

    pipe = Pipeline.from_pretrained(tiny_model, PipelineOptions(max_new_tokens=2))
    server, records = make_server(pipe)
    add_frames(server, 0)
    linear = next(m for m in pipe.rt.model.modules() if isinstance(m, torch.nn.Linear))
    weight = linear.weight.data
    linear.weight.data = weight[:, :1].clone()
    server.serve(server.submit(QueryRequest("first?"), now_ns=1), now_ns=1)
    linear.weight.data = weight
    server.serve(server.submit(QueryRequest("second?"), now_ns=2), now_ns=2)
    assert [r.status for r in records] == ["pipeline_error", "ok"]
    assert "RuntimeError" in records[0].status_message


def test_worker_thread_answers_every_query_exactly_once(pipeline):
    import time

    server, records = make_server(pipeline, clock_ns=time.time_ns, queue_size=2)
    add_frames(server, time.time_ns())
    server.start_worker()
    for i in range(6):
        server.submit(QueryRequest(f"question {i}", query_id=f"w{i}"))
    deadline = time.time() + 60
    while len(records) < 6 and time.time() < deadline:
        time.sleep(0.05)
    server.stop_worker()
    ids = sorted(r.query_id for r in records)
    assert ids == [f"w{i}" for i in range(6)]
    assert {r.status for r in records} <= {"ok", "queue_full"} and any(r.status == "ok" for r in records)
    stats = server.stats()
    assert stats["answered"] == 6 and stats["queue_depth"] == 0


def test_queued_queries_are_all_served_between_prefetches(pipeline):
    """A queue deep enough for every query: each is answered ok, none lost to the idle-time
    prefetch of the frame set (visual reuse) that runs between them."""
    import time

    server, records = make_server(pipeline, clock_ns=time.time_ns, queue_size=8)
    add_frames(server, time.time_ns())
    server.start_worker()
    for i in range(6):
        server.submit(QueryRequest(f"question {i}", query_id=f"p{i}"))
        time.sleep(0.01)
    deadline = time.time() + 60
    while len(records) < 6 and time.time() < deadline:
        time.sleep(0.05)
    server.stop_worker()
    assert sorted((r.query_id, r.status) for r in records) == [(f"p{i}", "ok") for i in range(6)]


def test_prefetch_never_touches_the_queue(pipeline):
    """The idle-time prefetch stops for a waiting query and leaves it queued (and unanswered) for
    the worker."""
    server, records = make_server(pipeline, queue_size=4)
    add_frames(server, 0)
    first = server.submit(QueryRequest("first?"), now_ns=1)
    server.serve(server.queue.get(timeout=0), now_ns=1)
    pipeline.rt.features.clear()                 # the frame set's views to encode again
    arrived = []
    real = pipeline.prefetch

    def prefetch_while_a_query_arrives(images, keys, stop):
        arrived.append(server.submit(QueryRequest("second?"), now_ns=2))          # arrives during the prefetch
        return real(images, keys, stop)

    pipeline.prefetch = prefetch_while_a_query_arrives
    try:
        server.prefetch(first)
    finally:
        del pipeline.prefetch
    assert len(server.queue) == 1 and [r.query_id for r in records] == [first.query_id]
    server.serve(server.queue.get(timeout=0), now_ns=3)
    assert [r.status for r in records] == ["ok", "ok"] and records[1].query_id == arrived[0].query_id


def test_query_waits_for_frames_in_flight_then_gives_up(pipeline):
    """frame_match newest: a failed match is retried until match_wait_s is over."""
    server, records = make_server(pipeline, match_wait_s=0.2, frame_match="newest")
    add_frames(server, 0)
    server.frames.add(Frame("CAM_BACK", 900 * MS, CompressedPayload("jpeg", jpeg(9))), now_ns=900 * MS)
    # At 1.05 s five cameras are stale; their new frames are "in flight" and arrive at 1.1 s.
    assert server.submit(QueryRequest("early?", query_id="wait_ok"), now_ns=1050 * MS) is None and not records
    server.retry_pending(now_ns=1080 * MS)
    assert not records and server.stats()["waiting_for_frames"] == 1
    add_frames(server, 1000 * MS)
    server.retry_pending(now_ns=1100 * MS)
    req = server.queue.drain()
    assert [r.query_id for r in req] == ["wait_ok"] and req[0].received_ns == 1050 * MS
    # A camera that never comes: refused once the wait is over, with the match error.
    server.frames = type(server.frames)(CAMERAS, server.frames.max_skew_ns, server.frames.max_age_ns)
    add_frames(server, 2000 * MS, None)
    server.submit(QueryRequest("nothing behind?", query_id="wait_fail"), now_ns=3100 * MS)
    server.retry_pending(now_ns=3200 * MS)
    assert not records
    server.retry_pending(now_ns=3301 * MS)
    assert [(r.query_id, r.status) for r in records] == [("wait_fail", "stale_frames")]
    assert "after waiting 0.20 s" in records[0].status_message
    # Shutting down answers whatever still waits.
    server.submit(QueryRequest("last?", query_id="wait_stop"), now_ns=3400 * MS)
    server.stop_worker("node shutting down")
    assert records[-1].query_id == "wait_stop" and records[-1].status == "not_active"


def test_as_asked_takes_the_set_stamped_before_the_question_whenever_frames_arrive(pipeline):
    """frame_match as_asked (the default): a query waits until every camera has sent a frame from
    after its stamp (or match_wait_s is over) and gets the newest set stamped at or before it,
    whatever arrived first: late frames of its own set, or a newer set already there."""
    for newer_first in (False, True):
        server, records = make_server(pipeline, match_wait_s=0.5)
        add_frames(server, 900 * MS)
        if newer_first:      # the next set (after the question) is already in when the query comes
            add_frames(server, 1200 * MS, {c: CompressedPayload("jpeg", jpeg(50 + i)) for i, c in enumerate(CAMERAS)})
        queued = server.submit(QueryRequest("front?", query_id=f"q{newer_first}", stamp_ns=1050 * MS), now_ns=1060 * MS)
        assert (queued is None) == (not newer_first)
        if not newer_first:  # its own set arrives late, then the next one
            server.retry_pending(now_ns=1100 * MS)
            assert server.stats()["waiting_for_frames"] == 1
            add_frames(server, 1000 * MS)
            server.retry_pending(now_ns=1150 * MS)
            assert server.stats()["waiting_for_frames"] == 1          # the question's set may still grow
            add_frames(server, 1200 * MS, {c: CompressedPayload("jpeg", jpeg(50 + i)) for i, c in enumerate(CAMERAS)})
            server.retry_pending(now_ns=1210 * MS)
        (req,) = server.queue.drain()
        expected = 1000 * MS if not newer_first else 900 * MS
        assert {f.stamp_ns for f in req.frames.frames.values()} == {expected}
    # Every camera silent after the question: matched as of it once match_wait_s is over.
    server, records = make_server(pipeline, match_wait_s=0.5)
    add_frames(server, 900 * MS)
    assert server.submit(QueryRequest("front?", stamp_ns=1000 * MS), now_ns=1000 * MS) is None
    server.retry_pending(now_ns=1400 * MS)
    assert not len(server.queue)
    server.retry_pending(now_ns=1501 * MS)
    (req,) = server.queue.drain()
    assert {f.stamp_ns for f in req.frames.frames.values()} == {900 * MS}


def test_question_is_checked_before_the_frames(pipeline):
    # A reserved token with a stale camera used to get stale_frames; with no frames, no_frames.
    server, records = make_server(pipeline)
    server.submit(QueryRequest("what is <img> here?", query_id="no_frames_yet"), now_ns=1)
    add_frames(server, 0)
    server.submit(QueryRequest("what is <|im_end|> here?", query_id="stale"), now_ns=5000 * MS)
    server.submit(QueryRequest("is the road clear?", query_id="really_stale"), now_ns=5000 * MS)
    assert [(r.query_id, r.status) for r in records] == [
        ("no_frames_yet", "bad_question"), ("stale", "bad_question"), ("really_stale", "stale_frames")]
    assert "<|im_end|>" in records[1].status_message


def test_a_1x1_jpeg_is_refused_like_a_1x1_raw_image(pipeline):
    server, records = make_server(pipeline)
    tiny_jpeg = CompressedPayload("jpeg", jpeg(5, size=(1, 1)))
    tiny_raw = RawPayload("rgb8", 1, 1, 3, b"\0\0\0")
    for t, payload in ((1, tiny_jpeg), (2, tiny_raw)):
        add_frames(server, t * MS, {"CAM_FRONT": payload})
        server.serve(server.submit(QueryRequest("What is in front?"), now_ns=t * MS), now_ns=t * MS)
    assert [r.status for r in records] == ["bad_image", "bad_image"]
    assert all(r.status_message.startswith("CAM_FRONT: image is 1x1 pixels") for r in records)


def test_duplicate_ids_are_answered_once_and_node_ids_never_collide(pipeline):
    server, records = make_server(pipeline, queue_size=8)
    add_frames(server, 0)
    assert server.submit(QueryRequest("first?", query_id="a"), now_ns=1) is not None
    assert server.submit(QueryRequest("again?", query_id="a"), now_ns=2) is None        # the same id again
    assert [(r.query_id, r.status) for r in records] == [("a", "duplicate_id")]
    assert "already used" in records[0].status_message and records[0].question == "again?"
    # (it said "this one is not answered" in the very answer it was: issue 42)
    assert "not answered" not in records[0].status_message and "keeps its own answer" in records[0].status_message
    # A caller that happens to use the node's own id form: the node's ids skip it.
    assert server.submit(QueryRequest("caller's q1", query_id="q1"), now_ns=3) is not None
    assert server.submit(QueryRequest("caller's q3", query_id="q3"), now_ns=3) is not None
    assigned = [server.submit(QueryRequest(f"string question {i}"), now_ns=4).query_id for i in range(3)]
    assert assigned == ["q2", "q4", "q5"]
    assert server.submit(QueryRequest("caller reuses a node id", query_id="q4"), now_ns=5) is None
    assert [(r.query_id, r.status) for r in records][-1] == ("q4", "duplicate_id")
    queued = [r.query_id for r in server.queue.drain()]
    assert queued == ["a", "q1", "q3", "q2", "q4", "q5"] and len(set(queued)) == len(queued)


def test_duplicate_detection_remembers_a_bounded_number_of_ids(pipeline, monkeypatch):
    from litevlm_runtime.serving import server as server_module

    monkeypatch.setattr(server_module, "ID_MEMORY", 3)
    server, records = make_server(None)
    for qid in ("a", "b", "c", "d"):
        server.submit(QueryRequest("hello?", query_id=qid), now_ns=1)       # not active: answered, ids remembered
    server.submit(QueryRequest("hello?", query_id="b"), now_ns=1)           # still remembered
    server.submit(QueryRequest("hello?", query_id="a"), now_ns=1)           # forgotten (the window holds b, c, d)
    assert [r.status for r in records][-2:] == ["duplicate_id", "not_active"]
    assert len(server._seen_ids) == 3


class SlowPipeline:
    """The real pipeline, with each answer held until the test releases it: a query that is
    running when shutdown begins, without depending on how fast this machine is."""

    def __init__(self, pipe, hold: float = 30.0):
        import threading

        self.pipe, self.rt, self.hold = pipe, pipe.rt, hold
        self.started, self.release = threading.Event(), threading.Event()

    def answer(self, images, question, **kw):
        self.started.set()
        self.release.wait(self.hold)
        return self.pipe.answer(images, question, **kw)

    def begin(self, images, question, *args, **kw):      # the batched worker's entry (batching.py)
        self.started.set()
        self.release.wait(self.hold)
        return self.pipe.begin(images, question, *args, **kw)

    def finish(self, *args, **kw):
        return self.pipe.finish(*args, **kw)

    def prefetch(self, *args, **kw):
        return self.pipe.prefetch(*args, **kw)


def started_server(pipe, **kw):
    """A server on the real clock with frames of now and its worker running: (server, records)."""
    import time

    server, records = make_server(pipe, clock_ns=time.time_ns, **kw)
    add_frames(server, time.time_ns())
    server.start_worker()
    return server, records


def test_shutdown_finishes_the_running_query_and_answers_the_queued_ones(pipeline):
    import threading

    slow = SlowPipeline(pipeline)
    server, records = started_server(slow, queue_size=8)
    for i in range(6):
        server.submit(QueryRequest(f"question {i}", query_id=f"s{i}"))
    assert slow.started.wait(30)                              # s0 is running, s1..s5 queued
    threading.Timer(0.3, slow.release.set).start()            # s0 finishes during the drain
    assert server.shutdown(timeout_s=30) is True
    server.submit(QueryRequest("too late?", query_id="late"))               # intake has stopped
    got = {r.query_id: r for r in records}
    assert len(records) == 7 and set(got) == {f"s{i}" for i in range(6)} | {"late"}
    assert got["s0"].status == "ok"
    assert all(got[f"s{i}"].status == "shutting_down" and "queued" in got[f"s{i}"].status_message for i in range(1, 6))
    assert got["late"].status == "shutting_down" and "intake stopped" in got["late"].status_message
    stats = server.stats()
    assert stats["answered"] == 7 and stats["status_counts"]["shutting_down"] == 6
    assert server.shutdown() is True                          # twice: nothing more happens
    assert len(records) == 7


def test_shutdown_is_bounded_and_a_late_result_is_not_published_twice(pipeline):
    slow = SlowPipeline(pipeline)
    server, records = started_server(slow, queue_size=4, drain_timeout_s=0.2)
    server.submit(QueryRequest("stuck?", query_id="stuck"))
    server.submit(QueryRequest("queued?", query_id="queued"))
    assert slow.started.wait(30)
    assert server.shutdown() is False                         # gave up on the running query after 0.2 s
    assert [(r.query_id, r.status) for r in records] == [("queued", "shutting_down"), ("stuck", "shutting_down")]
    assert "drain_timeout_s 0.2" in records[1].status_message
    worker = threading_worker(server)
    slow.release.set()                                        # the stuck query finishes after all
    if worker is not None:
        worker.join(30)
    assert len(records) == 2                                  # ... and is not answered a second time


def threading_worker(server):
    import threading

    return next((t for t in threading.enumerate() if t.name == "litevlm-pipeline"), None)


def test_answers_that_fail_to_publish_are_not_counted_as_answered(pipeline):
    delivered = []

    def publish(rec):
        if rec.query_id == "lost":
            raise RuntimeError("Failed to publish: publisher's context is invalid")
        delivered.append(rec)

    server = QueryServer(ServerSettings(), publish, clock_ns=lambda: 0)
    server.submit(QueryRequest("hello?", query_id="kept"), now_ns=1)
    server.submit(QueryRequest("hello?", query_id="lost"), now_ns=1)
    stats = server.stats()
    assert [r.query_id for r in delivered] == ["kept"]
    assert stats["answered"] == 1 and stats["publish_failed"] == 1 and "lost" in stats["last_error"]


def test_future_stamped_frames_are_not_served_and_counted(pipeline):
    server, records = make_server(pipeline, max_future_s=0.5)
    add_frames(server, 0)
    for cam in CAMERAS:                                       # every camera 5 s ahead, arriving at 0.1 s
        server.frames.add(Frame(cam, 5100 * MS, CompressedPayload("jpeg", jpeg(1))), now_ns=100 * MS)
    server.submit(QueryRequest("in front?", query_id="f"), now_ns=1500 * MS)
    assert [(r.query_id, r.status) for r in records] == [("f", "bad_stamp")]
    assert "CAM_FRONT 5.000 s" in records[0].status_message
    assert server.stats()["frames_bad_stamp"] == {c: 1 for c in CAMERAS}


def test_a_query_that_arrives_while_the_worker_prefetches_is_answered(pipeline):
    # The worker encodes the rest of a frame set when idle (visual reuse) and stops when a query
    # arrives; the query must then be served (it was answered not_active once).
    import threading

    class HeldPrefetch(SlowPipeline):
        def answer(self, images, question, **kw):
            return self.pipe.answer(images, question, **kw)

        def begin(self, images, question, *args, **kw):
            return self.pipe.begin(images, question, *args, **kw)

        def prefetch(self, images, keys, stop):
            self.started.set()
            end = threading.Event()
            while not stop() and not end.wait(0.01):
                pass
            return []

    held = HeldPrefetch(pipeline)
    server, records = started_server(held, queue_size=4)
    server.submit(QueryRequest("first?", query_id="p0"))
    assert held.started.wait(30)                              # p0 answered, the worker is prefetching
    server.submit(QueryRequest("second?", query_id="p1"))
    import time

    end = time.time() + 30
    while len(records) < 2 and time.time() < end:
        time.sleep(0.02)
    server.stop_worker()
    assert [(r.query_id, r.status) for r in records] == [("p0", "ok"), ("p1", "ok")]


def test_prefetch_encodes_the_frame_set_the_next_query_would_get(pipeline):
    """After an answer the idle worker encodes the newest frame set (a newer one may have come
    while it answered), not the rest of the set it answered about, which no query matches again."""
    server, records = make_server(pipeline)
    features = pipeline.rt.features
    assert features is not None
    features.clear()
    add_frames(server, 0)
    req = server.submit(QueryRequest("What is in front?"), now_ns=1 * MS)
    server.queue.drain()
    server.serve(req, now_ns=1 * MS)
    newer = {c: CompressedPayload("jpeg", jpeg(20 + i)) for i, c in enumerate(CAMERAS)}
    add_frames(server, 100 * MS, newer)                  # the next set arrived during the answer
    server.clock_ns = lambda: 110 * MS
    before = set(features.index)
    server.prefetch(req)
    encoded = set(features.index) - before
    assert {stamp for (_, (stamp, _)) in encoded} == {100 * MS} and len(encoded) == len(CAMERAS)
    server.prefetch(req)                                 # nothing left to do for that set
    assert set(features.index) - before == encoded


def test_partials_and_budget_reach_the_pipeline(pipeline, monkeypatch):
    """A query's budget_ms is the pipeline's budget (bad values refused naming it); partials go
    out while decoding, the last one final with the record's text; a query that fails after
    partials gets a final partial with the error's empty text; stream_partials false: none."""
    partials = []
    server, records = make_server(pipeline, publish_partial=partials.append)
    add_frames(server, 1000 * MS)
    budgets = []
    real_answer = pipeline.answer
    monkeypatch.setattr(pipeline, "answer", lambda *a, **kw: (budgets.append(a[1].budget_ms), real_answer(*a, **kw))[1])

    rec = server.serve(
        server.submit(QueryRequest("What is in front?", query_id="a", budget_ms=250.0), now_ns=1000 * MS),
        now_ns=1000 * MS,
    )
    assert rec.status == "ok" and budgets == [250.0]
    assert [p.token_count for p in partials] == [*range(1, len(rec.token_ids) + 1), len(rec.token_ids)]
    assert [p.final for p in partials] == [False] * len(rec.token_ids) + [True]
    assert partials[-1].text == partials[-2].text == rec.text and {p.query_id for p in partials} == {"a"}

    for bad in (-1.0, float("nan"), float("inf")):
        assert (
            server.submit(QueryRequest("What is in front?", query_id=f"b{bad}", budget_ms=bad), now_ns=1000 * MS)
            is None
        )
        assert records[-1].status == "bad_question" and "budget_ms" in records[-1].status_message

    partials.clear()

    def fails_after_two_tokens(images, question, on_tokens=None, **kw):
        on_tokens([5])
        on_tokens([5, 6])
        raise RuntimeError("engine lost")
    monkeypatch.setattr(pipeline, "answer", fails_after_two_tokens)
    rec = server.serve(server.submit(QueryRequest("What is behind?", query_id="c"), now_ns=1000 * MS), now_ns=1000 * MS)
    assert rec.status == "pipeline_error"
    assert [(p.token_count, p.final, p.text) for p in partials[-1:]] == [(0, True, "")] and len(partials) == 3

    monkeypatch.setattr(pipeline, "answer", real_answer)
    partials.clear()
    opts = pipeline.rt.options
    monkeypatch.setattr(pipeline.rt, "options", dataclasses.replace(
        opts, serving=dataclasses.replace(opts.serving, stream_partials=False)))
    rec = server.serve(
        server.submit(QueryRequest("What is in front?", query_id="d"), now_ns=1000 * MS), now_ns=1000 * MS
    )
    assert rec.status == "ok" and rec.token_ids and not partials


def test_a_query_waiting_for_frames_is_answered_when_its_deadline_passes(pipeline):
    """expire_deadlines once unpacked 7 of a waiting query's 8 fields and raised (in the node: from
    its 10 ms timer, out of the executor) when a query waiting for frames reached its deadline."""
    server, records = make_server(pipeline, match_wait_s=1.0)
    assert (
        server.submit(QueryRequest("anything behind?", query_id="w", deadline_ns=1020 * MS), now_ns=1000 * MS) is None
    )
    server.expire_deadlines(now_ns=1010 * MS)
    assert not records and server.stats()["waiting_for_frames"] == 1
    server.expire_deadlines(now_ns=1030 * MS)
    assert [(r.query_id, r.status) for r in records] == [("w", "deadline_passed")]
    assert "waiting for frames" in records[0].status_message and server.stats()["waiting_for_frames"] == 0


def test_a_querys_temperature_and_seed_are_checked_and_reach_the_pipeline(pipeline):
    server, records = make_server(pipeline)
    add_frames(server, 1000 * MS)
    for i, (field, value) in enumerate([("temperature", -0.5), ("temperature", float("nan")),
                                        ("temperature", 11.0), ("seed", -3)]):
        assert (
            server.submit(QueryRequest("What is in front?", query_id=f"bad{i}", **{field: value}), now_ns=1000 * MS)
            is None
        )
        assert records[-1].status == "bad_question" and records[-1].status_message.startswith(f"{field} ")
    rec = server.serve(
        server.submit(QueryRequest("What is in front?", query_id="s", temperature=2.0, seed=11), now_ns=1000 * MS),
        now_ns=1000 * MS,
    )
    images = {c: jpeg(CAMERAS.index(c)) for c in CAMERAS}
    assert rec.status == "ok"
    assert (
        rec.token_ids == pipeline.answer(images, QueryRequest("What is in front?", temperature=2.0, seed=11)).token_ids
    )
    assert rec.token_ids != pipeline.answer(images, "What is in front?").token_ids     # (greedy: the node's default)


def test_a_follow_up_is_served_on_the_frames_of_the_query_it_follows(pipeline):
    """Its frames are the earlier query's, whatever arrived since; its answer is the conversation's
    from scratch; an unknown id is bad_follow_up at once, naming it, and one whose conversation
    expired before it ran is bad_follow_up when it runs."""
    server, records = make_server(pipeline)
    add_frames(server, 1000 * MS)
    pipeline.rt.conversations.clear()
    first = server.serve(
        server.submit(QueryRequest("What is in front?", query_id="q1"), now_ns=1000 * MS), now_ns=1000 * MS
    )
    assert server.stats()["conversations"] == 1                 # (on /diagnostics)
    newer = {c: CompressedPayload("jpeg", jpeg(40 + i)) for i, c in enumerate(CAMERAS)}
    add_frames(server, 1500 * MS, newer)
    req = server.submit(QueryRequest("Is it moving?", query_id="q2", follow_up_of="q1"), now_ns=1500 * MS)
    assert {c: f.stamp_ns for c, f in req.frames.frames.items()} == {c: 1000 * MS for c in CAMERAS}
    rec = server.serve(req, now_ns=1500 * MS)
    images = {c: jpeg(CAMERAS.index(c)) for c in CAMERAS}
    scratch = pipeline.answer(images, QueryRequest("Is it moving?", history=[("What is in front?", first.text)]))
    assert rec.status == "ok" and (rec.turn, rec.follow_up_of) == (2, "q1") and rec.reused_tokens > 0
    assert rec.token_ids == scratch.token_ids and rec.prompt_sha256 == scratch.prompt_sha256
    assert rec.to_json()["turn"] == 2 and rec.frame_stamps_ns == {c: 1000 * MS for c in CAMERAS}

    assert server.submit(QueryRequest("And behind?", query_id="q3", follow_up_of="nope"), now_ns=1500 * MS) is None
    assert records[-1].status == "bad_follow_up" and "'nope'" in records[-1].status_message
    late = server.submit(QueryRequest("And behind?", query_id="q4", follow_up_of="q2"), now_ns=1500 * MS)
    pipeline.rt.conversations.clear()          # (as if four later answers had taken every slot)
    assert server.serve(late, now_ns=1500 * MS).status == "bad_follow_up"


def test_a_refused_newest_frame_is_named_in_the_answer_that_used_its_camera(pipeline):
    """A raw Image refused on arrival for its size (height 4e9, width 2^32-1, 8000x8000 ...) while the
    camera's previous frame is still fresh: the query is answered from that frame, and the answer's
    `degraded` names the refusal for each camera it used (it used to say nothing: issue 42)."""
    server, records = make_server(pipeline, frame_match="newest")
    add_frames(server, 1000 * MS)
    why = "CAM_BACK: raw image 4000000000x640 above images.max_pixels (16777216); refused on arrival"
    server.frames.refuse("CAM_BACK", why)
    rec = server.serve(server.submit(QueryRequest("What is behind?", query_id="r"), now_ns=1100 * MS),
                       now_ns=1100 * MS)
    assert rec.status == "ok" and "CAM_BACK" in rec.cameras, (rec.status, rec.cameras)    # (the baseline: all six)
    assert rec.degraded == [f"older frame: {why}"], rec.degraded
