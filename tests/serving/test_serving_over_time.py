"""The query server over time (the node's serving code, no ROS; the real tiny pipeline): a query's
`frames` sets matched stride apart and answered as the pipeline answers them; the same inputs give
the same answer whatever was prefetched; the idle worker encodes each new frame set once; standing
questions answered once per changed frame set, never while the scene is frozen, and yielding to an
asked query after at most their current decode pass. Every query gets exactly one record."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import options
from helpers.ros import jpeg

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.pipeline.frame_sets import FrameSet as InputSet
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.serving.batch_worker import BatchWorker
from litevlm_runtime.serving.frame_store import Frame
from litevlm_runtime.serving.images import CompressedPayload
from litevlm_runtime.serving.server import GC_CLOCK, QueryServer
from litevlm_runtime.serving.settings import ServerSettings

MS = 1_000_000
T0 = 1_700_000_000_000 * MS
STRIDE = 500 * MS
QUESTION = "Is the white truck ahead moving?"


def images_of(k: int) -> dict[str, bytes]:
    """Frame set k's six JPEGs (each set its own scene)."""
    return {c: jpeg(1000 * k + i, size=(160, 90)) for i, c in enumerate(CAMERAS)}


@pytest.fixture(scope="module")
def pipe(tiny_model):
    return Pipeline.from_pretrained(tiny_model, options(max_new_tokens=6, decoding__mode="greedy",
                                                        temporal__frames=4))


class Rig:
    """A server over `pipe` with a clock the test moves, fed 2 Hz frame sets (the cameras share a
    stamp, as SynthDrive's)."""

    def __init__(self, pipe, **settings):
        self.now = T0
        self.records, self.standing = [], []
        self.server = QueryServer(ServerSettings(**{"match_wait_s": 0.0, **settings}), self.records.append,
                                  clock_ns=lambda: self.now,
                                  publish_standing=lambda name, rec: self.standing.append((name, rec)))
        self.server.load(lambda: pipe, warmup=False)
        self.server.active = True

    def frames(self, k: int, images: dict | None = None) -> int:
        stamp = T0 + k * STRIDE
        for cam, data in (images or images_of(k)).items():
            self.server.frames.add(Frame(cam, stamp, CompressedPayload("jpeg", data)), now_ns=stamp)
        self.now = stamp + 100 * MS
        return stamp

    def ask(self, qid: str, text: str = QUESTION, **fields):
        self.now += 10 * MS
        return self.server.submit(QueryRequest(text, query_id=qid, stamp_ns=self.now, **fields), now_ns=self.now)

    def serve(self, qid: str, text: str = QUESTION, **fields):
        """Ask and serve at once, as the worker takes it from the queue."""
        assert self.ask(qid, text, **fields) is not None
        return self.server.serve(self.server.queue.get(timeout=0), now_ns=self.now)


def direct(pipe, ks, question=QUESTION):
    """What the pipeline itself answers over frame sets `ks` (oldest first), without the server."""
    sets = [InputSet(images_of(k), {c: ("direct", k) for c in CAMERAS}) for k in ks]
    return pipe.answer(sets, QueryRequest(question, frames=len(ks)))


def test_a_query_over_four_sets_is_answered_from_the_sets_stride_apart(pipe):
    rig = Rig(pipe)
    stamps = [rig.frames(k) for k in range(6)]
    req = rig.ask("a")                                        # frames 0: temporal.frames, 4
    assert [s.newest_ns for s in req.sets] == stamps[2:]
    rec = rig.server.serve(rig.server.queue.get(timeout=0), now_ns=rig.now)
    want = direct(pipe, [2, 3, 4, 5])
    assert rec.status == "ok" and rec.token_ids == want.token_ids and rec.frames == want.frames == 4
    assert rec.frame_set_stamps_ns == stamps[2:] and rec.frame_stamps_ns == {c: stamps[5] for c in CAMERAS}
    assert rec.kept_per_frame == want.kept_per_frame and len(rec.kept_per_frame) == 4
    assert rec.to_json()["frame_set_offsets_ms"] == [(s - rec.query_stamp_ns) / 1e6 for s in stamps[2:]]
    one = rig.serve("b", frames=1)                            # the query's own frames win
    assert one.frames == 1 and one.frame_set_stamps_ns == stamps[5:] and one.token_ids == pipe.answer(
        images_of(5), QueryRequest(QUESTION, frames=1)).token_ids
    assert [r.query_id for r in rig.records] == ["a", "b"]


def test_a_missing_past_set_is_an_error_naming_the_step_and_the_camera(pipe):
    rig = Rig(pipe)
    for k in range(4):
        rig.frames(k, {c: d for c, d in images_of(k).items() if not (k == 1 and c == "CAM_BACK_LEFT")})
    assert rig.ask("gap") is None
    assert rig.ask("too_many", frames=5) is None
    assert rig.ask("three", frames=2) is not None
    gap, too_many = rig.records
    assert gap.status == "stale_frames" and "frame set t-2" in gap.status_message \
        and "CAM_BACK_LEFT" in gap.status_message and not gap.text
    assert too_many.status == "bad_question" and "temporal.max_frames 4" in too_many.status_message


def test_same_answers_whatever_was_prefetched_and_each_frame_encoded_once(pipe):
    cold, warm = Rig(pipe), Rig(pipe)
    pipe.rt.features.clear()
    got = {}
    for rig, prefetch in ((cold, False), (warm, True)):
        out = []
        for k in range(7):
            rig.frames(k)
            if prefetch:
                assert rig.server.ticking() and rig.server.idle_job() is None    # new sets encoded while idle
            if k >= 3:
                out.append(rig.serve(f"q{k}"))
            if not prefetch:
                pipe.rt.features.clear()            # nothing kept: every view encoded by the query
        got[prefetch] = out
    for a, b in zip(got[False], got[True]):
        assert a.status == b.status == "ok" and a.token_ids == b.token_ids and a.frames == b.frames == 4
        assert a.kept_per_frame == b.kept_per_frame
    assert [r.encoded_views for r in got[False]] == [24] * 4           # 6 cameras x 4 sets, every time
    assert [(r.encoded_views, r.reused_views) for r in got[True]] == [(0, 24)] * 4   # all prefetched when idle
    # without prefetching, a window moved by one set encodes that set only
    pipe.rt.features.clear()
    rig = Rig(pipe)
    for k in range(4):
        rig.frames(k)
    first = rig.serve("first")
    rig.frames(4)
    second = rig.serve("second")
    assert (first.encoded_views, second.encoded_views, second.reused_views) == (24, 6, 18)
    assert second.token_ids == got[False][1].token_ids


# ---------------------------------------------------------------- standing questions
STANDING = ("ahead: Is the white truck ahead moving?", "behind: What is behind the ego vehicle?")


def settle(rig, sets: int, timeout: float = 120.0) -> None:
    """Wait until every standing question has dealt with `sets` frame sets (answered, found unchanged,
    unmatched or failed): the worker thread follows the frames on its own."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = [q.answered + q.unchanged + q.unmatched + q.errors for q in rig.server.standing.questions.values()]
        if all(n >= sets for n in done) and not rig.server.running:
            return
        time.sleep(0.01)
    raise AssertionError(f"standing questions did not settle on {sets} sets: {rig.server.standing.stats()}")


def test_standing_questions_are_answered_once_per_changed_set_and_not_while_frozen(pipe):
    rig = Rig(pipe, standing_questions=STANDING, standing_frames=2)
    rig.server.start_worker()
    try:
        scene = []                            # which images each set shows: 0, 1, 2, then 2 frozen x 4, then 7, 8, 9
        for k in range(10):
            shown = k if k < 3 or k >= 7 else 2
            scene.append(shown)
            rig.frames(k, images_of(shown))
            settle(rig, k + 1)
            if k == 4:                       # an asked query meanwhile: one answer, on the answer topic
                rig.ask("asked")
        settle(rig, 10)
        deadline = time.monotonic() + 60
        while not rig.records and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        rig.server.stop_worker()
    assert [r.query_id for r in rig.records] == ["asked"] and rig.records[0].status == "ok"
    stats = rig.server.standing.stats()
    for name in ("ahead", "behind"):
        mine = [rec for n, rec in rig.standing if n == name]
        assert all(rec.status == "ok" for rec in mine), [rec.status_message for rec in mine]
        sets = [(rec.query_stamp_ns - T0) // STRIDE for rec in mine]
        # set 0 has no set before it (a 2-frame question: unmatched, not asked), sets 3-6 are set 2 again
        assert sets == [1, 2, 7, 8, 9], (name, sets, stats[name])
        assert stats[name]["unchanged"] == 4 and stats[name]["unmatched"] == 1 and stats[name]["answered"] == 5
        for rec in mine:
            k = (rec.query_stamp_ns - T0) // STRIDE
            assert rec.frame_stamps_ns == {c: rec.query_stamp_ns for c in CAMERAS}      # stamped with its frames
            assert rec.frame_set_stamps_ns[-1] == rec.query_stamp_ns and rec.frames == len(rec.frame_set_stamps_ns)
            assert rec.query_id.startswith(f"{name}#")
            assert rec.token_ids == direct(pipe, [scene[k - 1], scene[k]], rec.question).token_ids


def test_a_standing_question_yields_to_an_asked_query_after_its_decode_pass(tiny_model):
    pipe = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=24, decoding__mode="greedy",
                                                        serving__max_batch=1))
    rig = Rig(pipe, standing_questions=("long: Describe the scene in detail.",))
    for k in range(2):
        rig.frames(k)
    worker = BatchWorker(rig.server, GC_CLOCK)
    job = rig.server.idle_job()                      # the standing question due on the newest set
    assert job is not None and job.standing == "long"
    worker.admit(job)
    (running,) = worker.batch.running
    seen = {}
    real = running.on_tokens

    def arrives(ids):                                # an asked query arrives after the standing's 3rd token
        if real is not None:
            real(ids)
        if len(ids) == 3 and not seen:
            seen["at"] = len(ids)
            threading.Thread(target=rig.ask, args=("asked", "What is in front?")).run()
    running.on_tokens = arrives
    worker.tick(timeout=0)                          # decodes alone until the query waits: no pass after it came
    assert seen == {"at": 3} and len(running.tokens) == 3, running.tokens
    worker.tick(timeout=0)                          # preempted; the asked query admitted in its place
    assert rig.server.standing.questions["long"].preempted == 1
    assert [r.tag[0].query_id for r in worker.batch.running] in ([], ["asked"])
    for _ in range(200):
        if rig.records and rig.standing:
            break
        worker.tick(timeout=0)
    assert [r.query_id for r in rig.records] == ["asked"] and rig.records[0].status == "ok"
    assert rig.records[0].token_ids == pipe.answer(images_of(1), "What is in front?").token_ids
    (name, rec), = rig.standing                      # run again later from its start: the same answer
    assert name == "long" and rec.status == "ok"
    assert rec.token_ids == pipe.answer(images_of(1), "Describe the scene in detail.").token_ids
