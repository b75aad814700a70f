"""The query server: everything the ROS node does except talking ROS.

Plain Python, so that the node (worker thread, real DDS) and `litevlm bag eval` (no DDS, one
query at a time) run the very same code from "a query arrives" to "an answer record is ready".

Flow of one query:
  submit()  on the caller's thread (the executor, in the node): check the id (a caller's id
            seen before is answered duplicate_id; the node's own ids `q<N>` skip every id
            seen), validate the question (the pipeline's own checks: invisible-only text,
            reserved tokens, token count) *before* anything about frames, check the deadline,
            match a frame set in the FrameStore *now* (so the answer does not depend on how
            long the query waits), then enqueue. Anything that fails here is answered at once
            with an error status.
  serve()   on the worker thread: check the deadline again, convert the six frames, run
            Pipeline.answer, and turn the result or the failure into an AnswerRecord.
Every query produces exactly one record through `publish`, whatever happens (a request carries
a flag, set once under a lock, so that a drain that gives up on the running query and the
worker finishing it late cannot both answer it).

Shutdown (`shutdown`, for SIGINT/SIGTERM and lifecycle shutdown): intake stops (a query that
still arrives is answered shutting_down at once), every queued or frame-waiting query is
answered shutting_down, and the running query finishes, waited for at most drain_timeout_s (if
it runs longer it is answered shutting_down and its late result is discarded). Counts are of
records delivered: a record whose publish raised is counted in `publish_failed`, not answered.

Overflow policy of the bounded request queue (`queue_size`):
  reject_new   (default) a query arriving at a full queue is answered at once with
               queue_full; queued queries keep their place (first come, first served).
  drop_oldest  the oldest queued query is answered with queue_full and the new one is queued
               (freshest questions win; useful when only the latest question matters).
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..decoding.constrain import compile_constraint
from ..errors import InputError
from ..pipeline.answer import STAGES
from ..pipeline.pipeline import check_question
from ..stages.prompt import is_blank
from ..timing import percentile
from .batch_worker import work_batched
from .frame_store import FrameMatchError, FrameSet, FrameStore
from .images import CameraImages, FrameKeys, ImageError
from .settings import ServerSettings

log = logging.getLogger("litevlm.server")


class GcClock:
    """Total time spent in Python's garbage collector, whichever thread triggered it (under
    the GIL a collection stalls every thread). Installed once per process."""

    def __init__(self):
        self.total_ns = 0
        self._start = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        else:
            self.total_ns += time.perf_counter_ns() - self._start


GC_CLOCK = GcClock()

# Status names and codes; the codes are the STATUS_* constants of litevlm_msgs/Answer.
STATUS_CODES = {
    "ok": 0,
    "no_frames": 1,
    "stale_frames": 2,
    "out_of_sync": 3,
    "bad_image": 4,
    "bad_question": 5,
    "queue_full": 6,
    "deadline_passed": 7,
    "pipeline_error": 8,
    "not_active": 9,
    "shutting_down": 10,
    "bad_stamp": 11,
    "duplicate_id": 12,
    "bad_follow_up": 13,
}
# How many query ids are remembered for duplicate detection (about 100 bytes each).
ID_MEMORY = 65536
# A query's own sampling temperature, at most (the range of the decoding.temperature setting).
MAX_TEMPERATURE = 10.0
@dataclass
class Request:
    query_id: str
    text: str
    stamp_ns: int           # when the question was asked (query header stamp, or receipt time)
    deadline_ns: int        # 0: none
    received_ns: int
    frames: FrameSet | None  # None while it waits for frames (match_wait_s)
    budget_ms: float = 0.0  # the Query's latency budget (0: the pipeline's serving.latency_budget_ms)
    choices: tuple = ()     # constrained answer (constrain.py): one of these ...
    answer_schema: str = ""  # ... or JSON valid for this schema
    temperature: float = 0.0  # sampling (0: the pipeline's decoding.temperature) ...
    seed: int = 0           # ... and its seed (0: the pipeline's decoding.seed)
    follow_up_of: str = ""  # the answered query it continues (its frames are that query's)
    answered: bool = False  # set once, under QueryServer._answer_lock
    streamed: bool = False  # a partial answer was published: the last partial (final) must follow

    def pipeline_arguments(self) -> dict:
        """What Pipeline.answer and BatchDecoder.admit take from the query, besides images and text:
        the query is kept for follow-ups under its id (conversation.py)."""
        return dict(frame_keys=FrameKeys(self.frames.frames), budget_ms=self.budget_ms, choices=list(self.choices),
                    answer_schema=self.answer_schema, temperature=self.temperature or None, seed=self.seed or None,
                    follow_up_of=self.follow_up_of or None, turn_id=self.query_id)


@dataclass
class PartialRecord:
    """The answer so far (litevlm_msgs/AnswerPartial): after the first token, after every decode
    pass, and a last one with final=True and the Answer's text just before the Answer."""
    query_id: str
    text: str
    token_count: int
    final: bool = False


@dataclass
class AnswerRecord:
    query_id: str
    question: str
    status: str = "ok"
    status_message: str = ""
    answer: str = ""
    token_ids: list[int] = field(default_factory=list)
    cameras: list[str] = field(default_factory=list)
    stage_ms: dict[str, float] = field(default_factory=dict)
    queue_ms: float = 0.0
    visual_tokens: int = 0
    kept_tokens: int = 0
    input_tokens: int = 0
    decode_steps: int = 0
    accepted_length: float = 0.0
    pipeline: str = ""                  # which pipeline served ("baseline", "litevlm[views,tokens@0.8,eagle]")
    reused_cameras: list[str] = field(default_factory=list)   # visual features reused from earlier queries
    degraded: list[str] = field(default_factory=list)         # what a latency budget cut
    budget_ms: float = 0.0
    budget_met: bool = True
    batched_steps: int = 0              # decode steps taken together with other queries (in-flight batching)
    follow_up_of: str = ""              # the query it continues ("" for a first question)
    turn: int = 0                       # its turn in the conversation (1: a first question; 0: not answered)
    reused_tokens: int = 0              # prompt rows whose KV came from the turn it follows
    prompt_sha256: str = ""             # of its prompt's ids (Answer.prompt_sha256)
    # Where the pipeline's wall time went (diagnostics; the JSON form only): CPU time of the
    # serving thread (torch's intra-op threads beyond it are not counted), and garbage
    # collection. Wall minus CPU is time the thread was not running: other processes or threads.
    cpu_ms: float = 0.0
    gc_ms: float = 0.0
    query_stamp_ns: int = 0
    frame_stamps_ns: dict[str, int] = field(default_factory=dict)

    @property
    def status_code(self) -> int:
        return STATUS_CODES[self.status]

    @property
    def total_ms(self) -> float:
        return float(sum(self.stage_ms.values()))

    def to_json(self) -> dict:
        """The JSON mirror / JSON-lines form. Frame stamps are also given relative to the query
        stamp, which survives the replayer's re-stamping (bag eval and a DDS replay agree)."""
        return {
            "query_id": self.query_id,
            "question": self.question,
            "status": self.status,
            "status_code": self.status_code,
            "status_message": self.status_message,
            "answer": self.answer,
            "token_ids": list(self.token_ids),
            "cameras": list(self.cameras),
            "stage_ms": dict(self.stage_ms),
            "total_ms": self.total_ms,
            "queue_ms": self.queue_ms,
            "visual_tokens": self.visual_tokens,
            "kept_tokens": self.kept_tokens,
            "input_tokens": self.input_tokens,
            "decode_steps": self.decode_steps,
            "accepted_length": self.accepted_length,
            "pipeline": self.pipeline,
            "reused_cameras": list(self.reused_cameras),
            "degraded": list(self.degraded),
            "budget_ms": self.budget_ms,
            "budget_met": self.budget_met,
            "batched_steps": self.batched_steps,
            "follow_up_of": self.follow_up_of,
            "turn": self.turn,
            "reused_tokens": self.reused_tokens,
            "prompt_sha256": self.prompt_sha256,
            "cpu_ms": self.cpu_ms,
            "gc_ms": self.gc_ms,
            "query_stamp_ns": self.query_stamp_ns,
            "frame_stamps_ns": dict(self.frame_stamps_ns),
            "frame_offsets_ms": {c: (s - self.query_stamp_ns) / 1e6 for c, s in self.frame_stamps_ns.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> "AnswerRecord":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


class RequestQueue:
    """Bounded FIFO with the overflow policy above. queue.Queue cannot drop its oldest item
    atomically, hence this small class."""

    def __init__(self, size: int, policy: str):
        self.size, self.policy = size, policy
        self._items: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, req: Request) -> Request | None:
        """Queue `req`; returns the request that was refused (req or the evicted oldest) or None."""
        with self._cond:
            refused = None
            if self._closed:
                return req
            if len(self._items) >= self.size:
                if self.policy == "reject_new":
                    return req
                refused = self._items.popleft()
            self._items.append(req)
            self._cond.notify()
            return refused

    def get(self, timeout: float | None = None) -> Request | None:
        with self._cond:
            if not self._items and not self._closed:
                self._cond.wait(timeout)
            return self._items.popleft() if self._items else None

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take_expired(self, now_ns: int) -> list[Request]:
        """Remove and return the queued requests whose deadline has passed."""
        with self._cond:
            expired = [r for r in self._items if r.deadline_ns and now_ns > r.deadline_ns]
            for r in expired:
                self._items.remove(r)
            return expired

    def drain(self) -> list[Request]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def __len__(self) -> int:
        return len(self._items)


class QueryServer:
    def __init__(self, settings: ServerSettings, publish: Callable[[AnswerRecord], None],
                 clock_ns: Callable[[], int] = time.time_ns,
                 publish_partial: Callable[[PartialRecord], None] | None = None):
        self.publish_record = publish
        self.publish_partial = publish_partial    # None: no partial answers (serving.stream_partials)
        self.clock_ns = clock_ns
        self.queue: RequestQueue | None = None
        self.apply_settings(settings)
        self.pipeline = None          # set by load(); None while not configured
        self.load_error = ""          # why the model could not be loaded
        self.active = False
        self.accepting = True         # False once shutdown() began: every new query is answered shutting_down
        self._ids = itertools.count(1)
        self._seen_ids: set[str] = set()
        self._seen_order: deque[str] = deque()
        self._id_lock = threading.Lock()
        self._answer_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self.status_counts = {s: 0 for s in STATUS_CODES}
        self.publish_failed = 0
        self.latency_ms: dict[str, deque] = {s: deque(maxlen=1000) for s in (*STAGES, "total", "queue")}
        self.last_error = ""
        # Camera stamp -> arrival at the node: DDS transport (plus the camera's own delay on a live rig).
        self.frame_delay_ms: deque = deque(maxlen=1000)
        self._pending: list[tuple[int, Request]] = []   # (until, query) waiting for frames (match_wait_s)
        self._pending_lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._running: Request | None = None
        self._batch_running: list[Request] = []     # the requests of an in-flight batch (batch_worker.py)
        self._stop = threading.Event()

    def apply_settings(self, settings: ServerSettings) -> None:
        """(Re)build the frame store and the queue for new limits (the node does this on configure).
        Queries already queued move to the new queue; those beyond its size are answered queue_full."""
        self.settings = settings
        self.frames = FrameStore(settings.cameras, int(settings.max_skew_s * 1e9), int(settings.max_frame_age_s * 1e9),
                                 settings.frame_history, int(settings.max_future_s * 1e9), clock_ns=self.clock_ns,
                                 max_bytes=int(settings.frame_memory_mb * 1e6))
        old, self.queue = self.queue, RequestQueue(settings.queue_size, settings.overflow_policy)
        for req in old.drain() if old is not None else ():
            self._enqueue(req)

    # ---- model ----
    def load(self, factory: Callable[[], object], warmup: bool = True) -> None:
        """Load the pipeline (and warm it up on a synthetic frame set). A failure is kept: the
        server then answers every query with pipeline_error naming it, instead of going silent."""
        try:
            pipe = factory()
            if warmup:
                pipe.warm_up()       # one synthetic query; measures the speculation costs
            self.pipeline, self.load_error = pipe, ""
        except Exception as exc:  # noqa: BLE001 - reported in every answer and in /diagnostics
            self.pipeline, self.load_error = None, f"{type(exc).__name__}: {exc}"
            self.last_error = self.load_error
            log.error("model failed to load: %s", self.load_error)
            raise

    # ---- ids ----
    def _take_id(self, query_id: str) -> tuple[str, bool]:
        """(the query's id, whether it is new). An empty id gets the next `q<N>` not seen yet, so
        the node's ids never collide with a caller's. Ids are remembered for ID_MEMORY queries."""
        with self._id_lock:
            if not query_id:
                query_id = f"q{next(self._ids)}"
                while query_id in self._seen_ids:
                    query_id = f"q{next(self._ids)}"
            elif query_id in self._seen_ids:
                return query_id, False
            self._seen_ids.add(query_id)
            self._seen_order.append(query_id)
            if len(self._seen_order) > ID_MEMORY:
                self._seen_ids.discard(self._seen_order.popleft())
            return query_id, True

    # ---- queries ----
    def submit(self, text: str, query_id: str = "", stamp_ns: int = 0, deadline_ns: int = 0,
               now_ns: int | None = None, allow_wait: bool = True, budget_ms: float = 0.0,
               choices: Sequence[str] = (), answer_schema: str = "", temperature: float = 0.0, seed: int = 0,
               follow_up_of: str = "") -> Request | None:
        """Accept one query. Returns the queued Request, or None when it was answered at once
        or is waiting for frames (see match_wait_s and retry_pending). `budget_ms`: the query's
        latency budget (0: the pipeline's default); a negative or non-finite one is bad_question;
        `temperature` / `seed` likewise (0: the pipeline's). `follow_up_of`: an answered query's
        id whose conversation this one continues, on that query's frames (no frame match); an
        unknown or expired id, or one at serving.max_turns, is bad_follow_up."""
        now = self.clock_ns() if now_ns is None else now_ns
        query_id, new_id = self._take_id(query_id)
        rec = AnswerRecord(query_id=query_id, question=text, query_stamp_ns=stamp_ns or now, follow_up_of=follow_up_of)

        def refuse(status: str, message: str) -> None:
            rec.status, rec.status_message = status, message
            self._finish(rec)

        if not new_id:
            return refuse("duplicate_id", f"query id {query_id!r} was already used by an earlier query; "
                                          "this one is not answered (use a new id per query)")
        if not self.accepting:
            return refuse("shutting_down", "node is shutting down; the query arrived after intake stopped")
        if is_blank(text):
            return refuse("bad_question", "empty question (only whitespace, invisible, replacement (U+FFFD) or non-characters)")
        if len(text) > self.settings.max_question_chars:
            return refuse("bad_question", f"question has {len(text)} characters; max_question_chars is "
                                          f"{self.settings.max_question_chars}")
        if self.pipeline is None:
            if self.load_error:
                return refuse("pipeline_error", f"model not loaded: {self.load_error}")
            return refuse("not_active", "node is not configured (no model loaded)")
        if not self.active:
            return refuse("not_active", "node is not active")
        try:
            # The pipeline's own question checks (reserved tokens, token count), before frames:
            # a bad question is bad_question whatever the cameras are doing.
            check_question(self.pipeline.rt, text)
            if choices or answer_schema:
                compile_constraint(self.pipeline.rt, list(choices), answer_schema)
        except InputError as exc:
            return refuse("bad_question", str(exc))
        if not math.isfinite(budget_ms) or budget_ms < 0:
            return refuse("bad_question", f"budget_ms {budget_ms!r}: must be a finite number >= 0 (0: the node's default)")
        if not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
            return refuse("bad_question", f"temperature {temperature!r}: must be a finite number from 0 to "
                                          f"{MAX_TEMPERATURE:g} (0: the node's decoding.temperature)")
        if seed < 0:
            return refuse("bad_question", f"seed {seed!r}: must be >= 0 (0: the node's decoding.seed)")
        if deadline_ns and now > deadline_ns:
            return refuse("deadline_passed", f"deadline passed {(now - deadline_ns) / 1e6:.1f} ms before the query arrived")
        req = Request(query_id, text, stamp_ns or now, deadline_ns, now, None, budget_ms, tuple(choices), answer_schema,
                      temperature, seed, follow_up_of)
        if follow_up_of:
            try:     # the frames are the earlier turn's, whatever has arrived since
                turn = self.pipeline.rt.conversations.follow(follow_up_of)
            except InputError as exc:
                return refuse("bad_follow_up", str(exc))
            frames = getattr(turn.frame_keys, "source", None)     # (FrameKeys of the frames this server matched)
            if frames is None:
                return refuse("bad_follow_up", f"follow_up_of {follow_up_of!r}: not a query this server answered")
            req.frames = FrameSet(dict(frames))
            return self._enqueue(req)
        try:
            req.frames = self.frames.match(now)
        except FrameMatchError as exc:
            if allow_wait and self.settings.match_wait_s > 0:
                with self._pending_lock:
                    self._pending.append((now + int(self.settings.match_wait_s * 1e9), req))
                return None
            return refuse(exc.status, str(exc))
        return self._enqueue(req)

    def _enqueue(self, req: Request) -> Request | None:
        queue = self.queue
        refused = queue.put(req)
        if refused is req and queue.closed:
            status = "not_active" if self.accepting else "shutting_down"
            self._answer(req, self._record_for(req, status, f"the request queue closed ({status})"))
            return None
        if refused is not None:
            self._answer(refused, self._record_for(
                refused, "queue_full", f"request queue full ({self.settings.queue_size}, policy {self.settings.overflow_policy})"))
        return None if refused is req else req

    def retry_pending(self, now_ns: int | None = None) -> None:
        """Re-match the queries waiting for frames (the node calls this from a short timer):
        matched ones are queued, those whose wait is over are refused with the match error."""
        if not self._pending:
            return
        now = self.clock_ns() if now_ns is None else now_ns
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for item in pending:
            until, req = item
            try:
                req.frames = self.frames.match(now)
            except FrameMatchError as exc:
                if now < until:
                    with self._pending_lock:
                        self._pending.append(item)
                    continue
                rec = self._record_for(req, exc.status, f"{exc} (after waiting {self.settings.match_wait_s:.2f} s "
                                                        "for frames)")
                rec.queue_ms = (now - req.received_ns) / 1e6
                self._finish(rec)
                continue
            self._enqueue(req)

    def expire_deadlines(self, now_ns: int | None = None) -> None:
        """Answer deadline_passed every queued or frame-waiting query whose deadline has passed, at
        that moment rather than when the worker reaches it (the node calls this from a short timer)."""
        now = self.clock_ns() if now_ns is None else now_ns
        for req in self.queue.take_expired(now):
            rec = self._record_for(req, "deadline_passed", f"deadline passed after "
                                   f"{(now - req.received_ns) / 1e6:.1f} ms in the queue")
            rec.queue_ms = (now - req.received_ns) / 1e6
            self._answer(req, rec)
        with self._pending_lock:
            waiting, expired = [], []
            for item in self._pending:
                (expired if item[1].deadline_ns and now > item[1].deadline_ns else waiting).append(item)
            self._pending = waiting
        for _, req in expired:
            rec = self._record_for(req, "deadline_passed", f"deadline passed after {(now - req.received_ns) / 1e6:.1f} "
                                                           "ms waiting for frames")
            rec.queue_ms = (now - req.received_ns) / 1e6
            self._finish(rec)

    def serve(self, req: Request, now_ns: int | None = None) -> AnswerRecord:
        """Run one queued request through the pipeline; never raises."""
        rec = self._starting(req, now_ns)
        if rec.status != "ok":
            return self._answer(req, rec)
        try:
            # Later questions about this frame set reuse its visual features (keyed by FrameKeys).
            cpu0, gc0 = time.thread_time_ns(), GC_CLOCK.total_ns
            ans = self.pipeline.answer(self._images(req), req.text, on_tokens=self._partials_of(req),
                                       **req.pipeline_arguments())
            rec.cpu_ms, rec.gc_ms = (time.thread_time_ns() - cpu0) / 1e6, (GC_CLOCK.total_ns - gc0) / 1e6
        except Exception as exc:  # noqa: BLE001 - a failing query must not stop the server
            return self._answer(req, self._failed(req, rec, exc))
        return self._answer(req, self._answered(rec, ans))

    def _starting(self, req: Request, now_ns: int | None = None) -> AnswerRecord:
        """The record of a request leaving the queue: ok, or deadline_passed."""
        now = self.clock_ns() if now_ns is None else now_ns
        rec = self._record_for(req, "ok", "")
        rec.queue_ms = max(0.0, (now - req.received_ns) / 1e6)
        if req.deadline_ns and now > req.deadline_ns:
            rec.status, rec.status_message = "deadline_passed", (
                f"deadline passed after {rec.queue_ms:.1f} ms in the queue")
        return rec

    def _images(self, req: Request) -> CameraImages:
        return CameraImages({c: f.payload for c, f in req.frames.frames.items()}, self.pipeline.rt.options.images.max_pixels)

    def _failed(self, req: Request, rec: AnswerRecord, exc: Exception) -> AnswerRecord:
        """`rec` with the status of a pipeline failure."""
        if isinstance(exc, ImageError):
            rec.status, rec.status_message = "bad_image", str(exc)
        elif isinstance(exc, InputError):
            # The error says what it is about: a camera's image, the follow-up (its conversation
            # expired since the query arrived), or the question (reserved token, too many tokens).
            status = {"image": "bad_image", "follow_up": "bad_follow_up"}.get(exc.about, "bad_question")
            rec.status, rec.status_message = status, str(exc)
        else:
            log.error("pipeline failed on %s: %s", req.query_id,
                      "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
            rec.status, rec.status_message = "pipeline_error", f"{type(exc).__name__}: {exc}"
        return rec

    def _answered(self, rec: AnswerRecord, ans) -> AnswerRecord:
        """`rec` filled from the pipeline's Answer."""
        rec.answer = ans.text
        rec.token_ids = [int(t) for t in ans.token_ids]
        rec.cameras = list(ans.cameras)
        rec.stage_ms = {s: float(ans.stage_ms[s]) for s in ans.stage_ms}
        rec.visual_tokens, rec.kept_tokens = int(ans.visual_tokens), int(ans.kept_tokens)
        rec.input_tokens, rec.decode_steps = int(ans.input_tokens), int(ans.decode_steps)
        rec.accepted_length = float(ans.accepted_length)
        rec.pipeline = ans.pipeline
        rec.reused_cameras, rec.degraded = list(ans.reused_cameras), list(ans.degraded)
        rec.budget_ms, rec.budget_met = float(ans.budget_ms), bool(ans.budget_met)
        rec.batched_steps = int(ans.extra.get("batched_steps", 0))
        rec.turn, rec.reused_tokens, rec.prompt_sha256 = int(ans.turn), int(ans.reused_tokens), ans.prompt_sha256
        return rec

    def _record_for(self, req: Request, status: str, message: str) -> AnswerRecord:
        return AnswerRecord(
            query_id=req.query_id, question=req.text, status=status, status_message=message,
            query_stamp_ns=req.stamp_ns, follow_up_of=req.follow_up_of,
            frame_stamps_ns={c: f.stamp_ns for c, f in req.frames.frames.items()} if req.frames is not None else {},
        )

    def _answer(self, req: Request, rec: AnswerRecord) -> AnswerRecord:
        """Publish the one record of a queued request (a second attempt is discarded); a request
        whose answer was streamed gets its final partial, with the Answer's text, first."""
        with self._answer_lock:
            if req.answered:
                log.warning("%s: already answered; a late %s record is discarded", req.query_id, rec.status)
                return rec
            req.answered = True
        if req.streamed:
            self._send_partial(PartialRecord(req.query_id, rec.answer, len(rec.token_ids), final=True))
        return self._finish(rec)

    def _partials_of(self, req: Request):
        """The pipeline's on_tokens for `req`: each call publishes the answer so far, decoded as
        the final text is (so the last partial of an ok answer is its text); None when partials
        are off. Publishing stops once the request is answered (a drain gave up on it)."""
        if self.publish_partial is None or not self.pipeline.rt.options.serving.stream_partials:
            return None
        tok = self.pipeline.rt.tok

        def on_tokens(ids: list[int]) -> None:
            partial = PartialRecord(req.query_id, tok.decode(ids).strip(), len(ids))
            with self._answer_lock:     # no partial after the answer; none lost before it
                if req.answered:
                    return
                req.streamed = True
                self._send_partial(partial)
        return on_tokens

    def _send_partial(self, partial: PartialRecord) -> None:
        try:
            self.publish_partial(partial)
        except Exception:  # noqa: BLE001 - a partial is a courtesy: its failure must not fail the answer
            log.error("publishing a partial of %s failed: %s", partial.query_id, traceback.format_exc())

    def _finish(self, rec: AnswerRecord) -> AnswerRecord:
        try:
            self.publish_record(rec)
        except Exception:  # noqa: BLE001 - a failing publisher must not kill the worker
            log.error("publishing %s failed: %s", rec.query_id, traceback.format_exc())
            with self._stats_lock:
                self.publish_failed += 1
                self.last_error = f"{rec.query_id}: publishing its {rec.status} answer failed"
            return rec
        with self._stats_lock:
            self.status_counts[rec.status] += 1
            if rec.status == "ok":
                for s, ms in rec.stage_ms.items():
                    self.latency_ms.setdefault(s, deque(maxlen=1000)).append(ms)
                self.latency_ms["total"].append(rec.total_ms)
                self.latency_ms["queue"].append(rec.queue_ms)
            else:
                self.last_error = f"{rec.query_id}: {rec.status}: {rec.status_message}"
        return rec

    # ---- worker thread (the node) ----
    def start_worker(self) -> None:
        if self._worker is None:
            self._stop.clear()
            self._worker = threading.Thread(target=self._work, name="litevlm-pipeline", daemon=True)
            self._worker.start()

    def _answer_waiting(self, status: str, reason: str) -> None:
        """Answer whatever is queued or waiting for frames (nothing is lost)."""
        for req in self.queue.drain():
            self._answer(req, self._record_for(req, status, reason))
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for _, req in pending:
            self._finish(self._record_for(req, status, reason))

    def stop_worker(self, reason: str = "node deactivated") -> None:
        """Deactivate: the running query finishes; queued ones are answered not_active."""
        if self._worker is not None:
            self._stop.set()
            self.queue.close()
            self._worker.join()
            self._worker = None
        self._answer_waiting("not_active", reason)
        if self.queue.closed:
            self.queue = RequestQueue(self.settings.queue_size, self.settings.overflow_policy)

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Stop intake and drain (see the module docstring). Returns False when the running query
        was given up after `timeout_s` (default settings.drain_timeout_s). Safe to call twice."""
        timeout_s = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        self.accepting = False
        self.active = False
        self._stop.set()
        self.queue.close()
        self._answer_waiting("shutting_down", "node shutting down; the query was still queued")
        worker, finished = self._worker, True
        if worker is not None:
            worker.join(timeout_s)
            finished = not worker.is_alive()
            for running in ([self._running] if self._running is not None else []) + list(self._batch_running):
                if not finished:
                    self._answer(running, self._record_for(
                        running, "shutting_down", f"node shutting down; the query was still running after "
                                                  f"drain_timeout_s {timeout_s:.1f} s"))
            self._worker = None
        self._answer_waiting("shutting_down", "node shutting down")     # any that raced the first pass
        return finished

    def _work(self) -> None:
        if self.pipeline is not None and self.pipeline.rt.arena.limits.batch > 1:
            return work_batched(self, GC_CLOCK)           # in-flight batching (serving.max_batch)
        while not self._stop.is_set():
            req = self.queue.get(timeout=0.2)
            if req is not None:
                self._running = req
                self.serve(req)
                self._running = None
                if not self._stop.is_set():
                    self.prefetch(req)

    def prefetch(self, req: Request) -> None:
        """Idle after `req`: encode into the pipeline's feature cache (visual reuse) the frame set
        a query arriving now would be matched to, stopping as soon as a query is waiting (or the
        worker is stopping). That is `req`'s set while no newer one has come (its later questions
        find every view encoded whichever cameras they select), else the newer set: the old one
        will not be matched again, and encoding it would only take the CPU from the next query."""
        pipe = self.pipeline
        if pipe is None or len(self.queue) or not pipe.rt.options.serving.feature_cache:
            return
        try:
            frames = self.frames.match(self.clock_ns()).frames
        except FrameMatchError:
            frames = req.frames.frames
        images = CameraImages({c: f.payload for c, f in frames.items()}, pipe.rt.options.images.max_pixels)
        try:
            pipe.prefetch(images, FrameKeys(frames), stop=lambda: len(self.queue) > 0 or self._stop.is_set())
        except Exception:  # noqa: BLE001 - prefetching is an optimisation: a failure must not stop serving
            log.error("prefetch after %s failed: %s", req.query_id, traceback.format_exc())

    # ---- diagnostics ----
    def stats(self) -> dict:
        with self._stats_lock:
            lat = {k: (percentile(v, 50), percentile(v, 90), len(v)) for k, v in self.latency_ms.items() if len(v)}
            counts = dict(self.status_counts)
            publish_failed = self.publish_failed
        return {
            "queue_depth": len(self.queue),
            "waiting_for_frames": len(self._pending),
            "queue_size": self.settings.queue_size,
            "overflow_policy": self.settings.overflow_policy,
            "answered": sum(counts.values()),          # delivered to the publisher
            "publish_failed": publish_failed,
            "status_counts": counts,
            "errors": sum(n for s, n in counts.items() if s != "ok"),
            "last_error": self.last_error,
            "latency_ms": lat,
            "frames_received": dict(self.frames.received),
            "frames_out_of_order": dict(self.frames.out_of_order),
            "frames_dropped": dict(self.frames.dropped),
            "frames_bad_stamp": dict(self.frames.bad_stamp),
            "frames_history_resets": dict(self.frames.history_resets),
            "frames_bad_image": dict(self.frames.bad_image),     # refused on arrival (too large)
            "frames_held_bytes": self.frames.held_bytes(),         # bounded by frame_memory_mb per camera
            "frames_memory_evictions": dict(self.frames.memory_evictions),
            # answered queries a follow-up may name now (serving.conversations at most)
            "conversations": len(self.pipeline.rt.conversations.turns) if self.pipeline is not None else 0,
            "frame_delay_ms": ((percentile(self.frame_delay_ms, 50), percentile(self.frame_delay_ms, 90))
                               if len(self.frame_delay_ms) else (0.0, 0.0)) + (len(self.frame_delay_ms),),
        }
