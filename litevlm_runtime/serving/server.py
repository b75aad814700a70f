"""The query server: everything the ROS node does except talking ROS.

Plain Python, so that the node (worker thread, real DDS) and `litevlm bag eval` (no DDS, one
query at a time) run the very same code from "a query arrives" to "an answer record is ready".

Flow of one query:
  submit()  on the caller's thread (the executor, in the node): check the id (a caller's id
            seen before is answered duplicate_id; the node's own ids `q<N>` skip every id
            seen), check the request once (QueryRequest.checked: invisible-only text, length,
            reserved tokens, token count, sampling, constraint, follow-up) *before* anything
            about frames, check the deadline,
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

The bounded request queue (queue.py) serves by priority, then arrival, with its overflow policy.

Explanations (explainer.py): with an Explainer, submit() decides once whether a query is explained
(the `explain` setting, the query's own flag, whether anyone subscribes); an explained answer's
trace goes to the Explainer after its record is delivered, so the answer is never later for it.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import replace
from typing import Callable

from ..errors import InputError
from ..pipeline.answer import STAGES
from ..pipeline.batching import BatchPolicy
from ..pipeline.frame_sets import FrameSet as InputSet
from ..pipeline.request import QueryRequest
from ..timing import percentile
from .batch_worker import BatchWorker
from .explainer import Explainer, wants
from .frame_store import PAST_TOLERANCE, FrameMatchError, FrameSet, FrameStore
from .images import CameraImages, FrameKeys, ImageError
from .queue import Queued, RequestQueue
from .record import STATUS_CODES, AnswerRecord, PartialRecord
from .settings import ServerSettings
from .standing import Standing

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

# How many query ids are remembered for duplicate detection (about 100 bytes each).
ID_MEMORY = 65536
class QueryServer:
    def __init__(self, settings: ServerSettings, publish: Callable[[AnswerRecord], None],
                 clock_ns: Callable[[], int] = time.time_ns,
                 publish_partial: Callable[[PartialRecord], None] | None = None,
                 explainer: Explainer | None = None, explanation_subscribed: Callable[[], bool] = lambda: False,
                 publish_standing: Callable[[str, AnswerRecord], None] | None = None):
        self.publish_record = publish
        self.publish_partial = publish_partial    # None: no partial answers (serving.stream_partials)
        self.explainer = explainer                # None: nothing is explained (explainer.py)
        self.explanation_subscribed = explanation_subscribed   # whether anyone takes explanations now
        self.clock_ns = clock_ns
        self.queue: RequestQueue | None = None
        self.apply_settings(settings)
        self.pipeline = None          # set by load(); None while not configured
        self.batch_policy = BatchPolicy()
        self.load_error = ""          # why the model could not be loaded
        self.integrity = ""           # the loaded folder's integrity_label (every record carries it)
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
        self.views_encoded = self.views_reused = 0     # (camera, frame) views of ok answers: encoded, from the cache
        self.latency_ms: dict[str, deque] = {s: deque(maxlen=1000) for s in (*STAGES, "total", "queue")}
        self.last_error = ""
        # Camera stamp -> arrival at the node: DDS transport (plus the camera's own delay on a live rig).
        self.frame_delay_ms: deque = deque(maxlen=1000)
        self._pending: list[tuple[int, Queued]] = []   # (until, query) waiting for frames (match_wait_s)
        self._pending_lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self.running: list[Queued] = []     # what the worker runs now (several: a batch, batch_worker.py)
        self.stopping = threading.Event()
        # Standing questions (standing.py), published on ~/standing/NAME; none without a publisher.
        self.standing = Standing(self, publish_standing or (lambda name, rec: None))
        self._temporal_until = 0            # until then (node clock) a query over time was asked recently

    def apply_settings(self, settings: ServerSettings) -> None:
        """(Re)build the frame store and the queue for new limits (the node does this on configure).
        Queries already queued move to the new queue; those beyond its size are answered queue_full."""
        self.settings = settings
        old_frames = getattr(self, "frames", None)
        self.frames = FrameStore(settings.cameras, int(settings.max_skew_s * 1e9), int(settings.max_frame_age_s * 1e9),
                                 settings.frame_history, int(settings.max_future_s * 1e9), clock_ns=self.clock_ns,
                                 max_bytes=int(settings.frame_memory_mb * 1e6),
                                 window_ns=int(settings.frame_window_s * 1e9))
        if old_frames is not None:
            self.frames.carry_counters(old_frames)      # counters run since the server started
        old, self.queue = self.queue, RequestQueue(settings.queue_size, settings.overflow_policy)
        for req in old.drain() if old is not None else ():
            self._enqueue(req)
        self._seen_ns = 0                   # the newest frame set the idle worker has looked at (idle_job)
        self._prefetch_ns: int | None = None    # the newest it prefetched

    def apply_live(self, settings: ServerSettings) -> None:
        """Live limits (the settings marked live) while serving, in place. apply_settings would
        rebuild the frame store and the request queue, losing the frames held (queries would get
        no_frames until every camera sent again), the per-camera counters and every queued query
        (the worker takes from the new queue, so the old one's would never be answered). Here the
        queue keeps its requests: shrunk below its depth, it refuses new ones (reject_new) or
        answers its oldest queue_full (drop_oldest) until the worker has served it down; nothing
        goes unanswered."""
        self.settings = settings
        self.frames.max_skew_ns = int(settings.max_skew_s * 1e9)
        self.frames.max_age_ns = int(settings.max_frame_age_s * 1e9)
        self.queue.size, self.queue.policy = settings.queue_size, settings.overflow_policy

    # ---- model ----
    def load(self, factory: Callable[[], object], warmup: bool = True) -> None:
        """Load the pipeline (and warm it up on a synthetic frame set). A failure is kept: the
        server then answers every query with pipeline_error naming it, instead of going silent."""
        try:
            pipe = factory()
            self.standing.configure(pipe)       # (a bad standing question fails the load, named)
            if warmup:
                pipe.warm_up()       # one synthetic query; measures the speculation costs
            self.pipeline, self.load_error = pipe, ""
            self.batch_policy = BatchPolicy()     # batched or one at a time, as it pays (batch_worker.py)
        except Exception as exc:  # noqa: BLE001 - reported in every answer and in /diagnostics
            self.pipeline, self.load_error = None, f"{type(exc).__name__}: {exc}"
            self.standing.configure(None)
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
    def submit(self, request: QueryRequest, now_ns: int | None = None, allow_wait: bool = True) -> Queued | None:
        """Accept one query. Returns it queued, or None when it was answered at once or is waiting
        for frames (see match_wait_s and retry_pending). The request is checked here, once
        (QueryRequest.checked: the question, its budget, sampling, constraint and follow-up), before
        anything about frames: a bad one is bad_question (bad_follow_up for an unknown, expired or
        ended `follow_up_of`) whatever the cameras are doing. A follow-up is about the frames of the
        turn it follows: it is not matched."""
        now = self.clock_ns() if now_ns is None else now_ns
        query_id, new_id = self._take_id(request.query_id)
        job = Queued(request.with_id(query_id, now), now)

        def refuse(status: str, message: str) -> None:
            self._finish(self._record_for(job, status, message))

        if not new_id:
            return refuse("duplicate_id", f"query id {query_id!r} was already used by an earlier query, which keeps "
                                          "its own answer; this query was not run (use a new id per query)")
        if not self.accepting:
            return refuse("shutting_down", "node is shutting down; the query arrived after intake stopped")
        pipeline = self.pipeline          # (once: a lifecycle cleanup may drop it meanwhile)
        if pipeline is None:
            if self.load_error:
                return refuse("pipeline_error", f"model not loaded: {self.load_error}")
            return refuse("not_active", "node is not configured (no model loaded)")
        if not self.active:
            return refuse("not_active", "node is not active")
        try:
            job.request = job.request.checked(pipeline.rt, self.settings.max_question_chars)
        except InputError as exc:
            return refuse("bad_follow_up" if exc.about == "follow_up" else "bad_question", str(exc))
        explained = self.explainer is not None and wants(self.settings.explain, job.request,
                                                         self.explanation_subscribed)
        if explained != job.request.explain:      # (the request as served: its trace is taken, or not)
            job.request = replace(job.request, explain=explained)
        deadline = job.request.deadline_ns
        if deadline and now > deadline:
            return refuse(
                "deadline_passed", f"deadline passed {(now - deadline) / 1e6:.1f} ms before the query arrived"
            )
        if job.request.follow_up_of:
            turn = pipeline.rt.conversations.get(job.request.follow_up_of)
            frames = getattr(turn.frame_keys, "source", None) if turn is not None else None
            if frames is None:     # (FrameKeys of the frames this server matched)
                return refuse("bad_follow_up", f"follow_up_of {job.request.follow_up_of!r}: not a query this "
                                               "server answered")
            job.frames = FrameSet(dict(frames))
            return self._enqueue(job)
        final = not (allow_wait and self.settings.match_wait_s > 0)
        try:
            matched = self._match(job, now, final)
        except FrameMatchError as exc:
            return refuse(exc.status, str(exc))
        if matched is None:
            with self._pending_lock:
                self._pending.append((now + int(self.settings.match_wait_s * 1e9), job))
            return None
        *job.history, job.frames = matched
        job.history = tuple(job.history)
        if job.history:                   # the idle worker prefetches frame sets for a while (idle_job)
            self._temporal_until = now + int(self.settings.frame_window_s * 1e9)
        return self._enqueue(job)

    def stride_ns(self) -> int:
        pipeline = self.pipeline
        return int(pipeline.rt.options.temporal.stride_s * 1e9) if pipeline is not None else 0

    def frames_asked(self, request: QueryRequest) -> int:
        """How many frame sets a (checked) request is matched to: its `frames`, else temporal.frames."""
        pipeline = self.pipeline
        return request.frames or (pipeline.rt.options.temporal.frames if pipeline is not None else 1)

    def _match(self, job: Queued, now: int, final: bool) -> tuple[FrameSet, ...] | None:
        """The frame sets of `job`, oldest first (settings.frame_match; with frames K > 1 the K - 1
        sets before the newest, temporal.stride_s apart: frame_store.py), or None to wait for frames
        still in flight (not `final`): as_asked waits until every camera has sent a frame from after
        the question; either rule waits while the match fails. FrameMatchError when final."""
        as_asked = self.settings.frame_match == "as_asked"
        if as_asked and not final and not self.frames.complete(job.request.stamp_ns):
            return None
        try:
            return self.frames.match_over_time(now, job.request.stamp_ns if as_asked else None,
                                               self.frames_asked(job.request), self.stride_ns())
        except FrameMatchError:
            if final or as_asked:       # (as_asked: every frame up to the question is in; waiting cannot help)
                raise
            return None

    def _enqueue(self, req: Queued) -> Queued | None:
        queue = self.queue
        refused = queue.put(req)
        if refused is req and queue.closed:
            status = "not_active" if self.accepting else "shutting_down"
            self.deliver(req, self._record_for(req, status, f"the request queue closed ({status})"))
            return None
        if refused is not None:
            self.deliver(
                refused,
                self._record_for(
                    refused,
                    "queue_full",
                    f"request queue full ({self.settings.queue_size}, policy {self.settings.overflow_policy})",
                ),
            )
        return None if refused is req else req

    def waiting_for_frames(self) -> bool:
        return bool(self._pending)

    def next_wait_end(self) -> int | None:
        """When the first query waiting for frames stops waiting (its match_wait_s is over), or None."""
        with self._pending_lock:
            return min((until for until, _ in self._pending), default=None)

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
                matched = self._match(req, now, final=now >= until)
            except FrameMatchError as exc:
                waited = f" (after waiting {self.settings.match_wait_s:.2f} s for frames)" if now >= until else ""
                rec = self._record_for(req, exc.status, f"{exc}{waited}")
                rec.queue_ms = (now - req.received_ns) / 1e6
                self._finish(rec)
                continue
            if matched is None:
                with self._pending_lock:
                    self._pending.append(item)
                continue
            *history, req.frames = matched
            req.history = tuple(history)
            self._enqueue(req)

    def expire_deadlines(self, now_ns: int | None = None) -> None:
        """Answer deadline_passed every queued or frame-waiting query whose deadline has passed, at
        that moment rather than when the worker reaches it (the node calls this from a short timer)."""
        now = self.clock_ns() if now_ns is None else now_ns
        for req in self.queue.take_expired(now):
            rec = self._record_for(req, "deadline_passed", f"deadline passed after "
                                   f"{(now - req.received_ns) / 1e6:.1f} ms in the queue")
            rec.queue_ms = (now - req.received_ns) / 1e6
            self.deliver(req, rec)
        with self._pending_lock:
            waiting, expired = [], []
            for item in self._pending:
                deadline = item[1].request.deadline_ns
                (expired if deadline and now > deadline else waiting).append(item)
            self._pending = waiting
        for _, req in expired:
            rec = self._record_for(req, "deadline_passed", f"deadline passed after {(now - req.received_ns) / 1e6:.1f} "
                                                           "ms waiting for frames")
            rec.queue_ms = (now - req.received_ns) / 1e6
            self._finish(rec)

    def serve(self, req: Queued, now_ns: int | None = None) -> AnswerRecord:
        """Run one queued request through the pipeline; never raises."""
        rec = self.leaving_queue(req, now_ns)
        if rec.status != "ok":
            return self.deliver(req, rec)
        try:
            # Later questions about this frame set reuse its visual features (keyed by FrameKeys).
            cpu0, gc0 = time.thread_time_ns(), GC_CLOCK.total_ns
            images, keys = self.inputs(req)
            ans = self.pipeline.answer(images, req.request, frame_keys=keys, on_tokens=self.partials_of(req))
            rec.cpu_ms, rec.gc_ms = (time.thread_time_ns() - cpu0) / 1e6, (GC_CLOCK.total_ns - gc0) / 1e6
        except Exception as exc:  # noqa: BLE001 - a failing query must not stop the server
            return self.deliver(req, self.failed(req, rec, exc))
        return self.deliver(req, rec.answered(ans))

    def leaving_queue(self, req: Queued, now_ns: int | None = None) -> AnswerRecord:
        """The record of a request leaving the queue: ok, or deadline_passed."""
        now = self.clock_ns() if now_ns is None else now_ns
        rec = self._record_for(req, "ok", "")
        rec.queue_ms = max(0.0, (now - req.received_ns) / 1e6)
        if req.request.deadline_ns and now > req.request.deadline_ns:
            rec.status, rec.status_message = "deadline_passed", (
                f"deadline passed after {rec.queue_ms:.1f} ms in the queue")
        return rec

    def images(self, req: Queued, frames: FrameSet | None = None) -> CameraImages:
        """The images of `req`'s newest frame set (or of `frames`), converted when the pipeline reads them."""
        frames = req.frames if frames is None else frames
        return CameraImages({c: f.payload for c, f in frames.frames.items()},
                            self.pipeline.rt.options.images.max_pixels)

    def inputs(self, req: Queued) -> tuple:
        """What Pipeline.answer (and the batch decoder) takes for `req`: (images, frame_keys) of its one
        frame set, or (its frame sets oldest first, None) over time (pipeline/frame_sets.py; each set
        keyed by its frames' stamps, so that a camera frame is encoded once in every window it is in)."""
        if not req.history:
            return self.images(req), req.frame_keys
        return [InputSet(self.images(req, s), FrameKeys(s.frames)) for s in req.sets], None

    def failed(self, req: Queued, rec: AnswerRecord, exc: Exception) -> AnswerRecord:
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

    def _record_for(self, req: Queued, status: str, message: str) -> AnswerRecord:
        return AnswerRecord(
            query_id=req.query_id, question=req.request.question, status=status, status_message=message,
            query_stamp_ns=req.request.stamp_ns, follow_up_of=req.request.follow_up_of,
            model_integrity=self.integrity if self.pipeline is not None else "",
            frame_stamps_ns={c: f.stamp_ns for c, f in req.frames.frames.items()} if req.frames is not None else {},
            frame_set_stamps_ns=[s.newest_ns for s in req.sets] if req.frames is not None else [],
        )

    def deliver(self, req: Queued, rec: AnswerRecord) -> AnswerRecord:
        """Publish the one record of a queued request (a second attempt is discarded); a request
        whose answer was streamed gets its final partial, with the Answer's text, first. An
        explained answer's trace goes to the explainer after its record is out."""
        trace, rec.trace = rec.trace, None        # (the record published carries no tensors)
        refused = req.frames.refused if req.frames is not None else {}
        if rec.status == "ok" and refused:         # a camera it used was answered from an older frame
            rec.degraded = [*rec.degraded, *(f"older frame: {refused[c]}" for c in rec.cameras if c in refused)]
        if rec.status == "ok":                      # the sets it was computed from: the time selector's newest
            rec.frame_set_stamps_ns = rec.frame_set_stamps_ns[-rec.frames:]
        with self._answer_lock:
            if req.answered:
                log.warning("%s: already answered; a late %s record is discarded", req.query_id, rec.status)
                return rec
            req.answered = True
        if req.standing:                          # ~/standing/NAME, not the answer topic (standing.py)
            self.standing.answered(req, rec)
            return rec
        if req.streamed:
            self._send_partial(PartialRecord(req.query_id, rec.text, len(rec.token_ids), final=True))
        self._finish(rec)
        pipeline = self.pipeline
        if trace is not None and rec.status == "ok" and self.explainer is not None and pipeline is not None:
            self.explainer.submit(pipeline.rt, rec, trace, self.images(req))
        return rec

    def partials_of(self, req: Queued):
        """The pipeline's on_tokens for `req`: each call publishes the answer so far, decoded as
        the final text is (so the last partial of an ok answer is its text); None when partials
        are off. Publishing stops once the request is answered (a drain gave up on it); a query
        run again after a preemption publishes only past the tokens it had already shown."""
        if self.publish_partial is None or not self.pipeline.rt.options.serving.stream_partials:
            return None
        tok = self.pipeline.rt.tok

        def on_tokens(ids: list[int]) -> None:
            if len(ids) <= req.partial_tokens:
                return
            partial = PartialRecord(req.query_id, tok.decode(ids).strip(), len(ids))
            with self._answer_lock:     # no partial after the answer; none lost before it
                if req.answered:
                    return
                req.streamed, req.partial_tokens = True, len(ids)
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
                self.views_encoded += rec.encoded_views
                self.views_reused += rec.reused_views
                for s, ms in rec.stage_ms.items():
                    self.latency_ms.setdefault(s, deque(maxlen=1000)).append(ms)
                self.latency_ms["total"].append(rec.total_ms)
                self.latency_ms["queue"].append(rec.queue_ms)
            else:
                self.last_error = f"{rec.query_id}: {rec.status}: {rec.status_message}"
        return rec

    # ---- worker thread (the node) ----
    def start_worker(self) -> None:
        if self.explainer is not None:
            self.explainer.start()
        if self._worker is None:
            self.stopping.clear()
            self._worker = threading.Thread(target=self._work, name="litevlm-pipeline", daemon=True)
            self._worker.start()

    def _answer_waiting(self, status: str, reason: str) -> None:
        """Answer whatever is queued or waiting for frames (nothing is lost)."""
        for req in self.queue.drain():
            self.deliver(req, self._record_for(req, status, reason))
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for _, req in pending:
            self._finish(self._record_for(req, status, reason))

    def stop_worker(self, reason: str = "node deactivated") -> None:
        """Deactivate: the running query finishes; queued ones are answered not_active."""
        if self._worker is not None:
            self.stopping.set()
            self.queue.close()
            self._worker.join()
            self._worker = None
        if self.explainer is not None:           # (the explanations of answers already out are finished)
            self.explainer.stop(self.settings.drain_timeout_s)
        self._answer_waiting("not_active", reason)
        if self.queue.closed:
            self.queue = RequestQueue(self.settings.queue_size, self.settings.overflow_policy)

    def shutdown(self, timeout_s: float | None = None, give_up: threading.Event | None = None) -> bool:
        """Stop intake and drain (see the module docstring). Returns False when the running query
        was given up after `timeout_s` (default settings.drain_timeout_s), or as soon as `give_up`
        is set (a second SIGTERM: the stop is cut short). Safe to call twice."""
        timeout_s = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        self.accepting = False
        self.active = False
        self.stopping.set()
        self.queue.close()
        self._answer_waiting("shutting_down", "node shutting down; the query was still queued")
        worker, finished = self._worker, True
        if worker is not None:
            end = time.monotonic() + timeout_s
            while worker.is_alive() and time.monotonic() < end and not (give_up is not None and give_up.is_set()):
                worker.join(min(0.05, max(0.0, end - time.monotonic())))
            finished = not worker.is_alive()
            why = ("the stop was cut short (a further signal)" if give_up is not None and give_up.is_set()
                   else f"drain_timeout_s {timeout_s:.1f} s")
            for running in list(self.running):
                if not finished:
                    self.deliver(running, self._record_for(
                        running, "shutting_down", f"node shutting down; the query was still running after {why}"))
            self._worker = None
        self._answer_waiting("shutting_down", "node shutting down")     # any that raced the first pass
        if self.explainer is not None:
            self.explainer.stop(timeout_s)
        return finished

    def _work(self) -> None:
        if self.pipeline is not None and (self.pipeline.rt.arena.limits.batch > 1 or self.standing.questions):
            # in-flight batching (serving.max_batch), and standing questions, which yield to asked
            # queries after a decode pass
            return BatchWorker(self, GC_CLOCK).run()
        while not self.stopping.is_set():
            req = self.queue.get(timeout=0)
            if req is None:
                self.idle_job()
                req = self.queue.get(timeout=self.idle_wait(0.2))
            if req is not None:
                self.running.append(req)
                self.serve(req)
                self.running.remove(req)
                if not self.stopping.is_set():
                    self.prefetch(req)

    def prefetch(self, req: Queued) -> None:
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
            pipe.prefetch(images, FrameKeys(frames), stop=lambda: len(self.queue) > 0 or self.stopping.is_set())
        except Exception:  # noqa: BLE001 - prefetching is an optimisation: a failure must not stop serving
            log.error("prefetch after %s failed: %s", req.query_id, traceback.format_exc())

    def ticking(self) -> bool:
        """Whether the idle worker follows new frame sets (prefetching them, offering them to standing
        questions): with standing questions on, with temporal.frames > 1, or for frame_window_s after
        a query over time. Otherwise it prefetches after a query only: a CPU that serves rare
        one-frame questions is not kept busy encoding every frame set for nothing."""
        pipe = self.pipeline
        return pipe is not None and (self.standing.active or pipe.rt.options.temporal.frames > 1
                                     or self.clock_ns() < self._temporal_until)

    def idle_wait(self, timeout: float) -> float:
        """How long the idle worker waits for a query before it looks at the frames again."""
        return min(timeout, 0.05) if self.ticking() else timeout

    def idle_job(self) -> Queued | None:
        """What the worker does while no query waits, stopping as soon as one arrives: the new frame
        sets since it last looked (frame_store.sets_after, in stamp order) are offered to the standing
        questions, and those at least temporal.stride_s apart (the spacing of a query's sets, at most
        temporal.max_frames of them, newest first) are encoded into the feature cache, so that a
        query over time encodes only what is new; then the standing question due, if any (run by
        the batch worker at the lowest priority)."""
        pipe = self.pipeline
        if pipe is None or not self.ticking():
            return None
        stop = lambda: len(self.queue) > 0 or self.stopping.is_set()     # noqa: E731
        now, stride = self.clock_ns(), self.stride_ns()
        fresh = []
        for frame_set in self.frames.sets_after(self._seen_ns, now, int(self.settings.match_wait_s * 1e9)):
            self._seen_ns = frame_set.newest_ns
            self.standing.offer(frame_set, now)
            if self._prefetch_ns is None or frame_set.newest_ns - self._prefetch_ns >= stride * (1 - PAST_TOLERANCE):
                self._prefetch_ns = frame_set.newest_ns
                fresh.append(frame_set)
        if pipe.rt.options.serving.feature_cache:
            for frame_set in reversed(fresh[-pipe.rt.options.temporal.max_frames:]):
                if stop():
                    return None
                images = CameraImages({c: f.payload for c, f in frame_set.frames.items()},
                                      pipe.rt.options.images.max_pixels)
                try:
                    pipe.prefetch(images, FrameKeys(frame_set.frames), stop=stop)
                except Exception:  # noqa: BLE001 - prefetching is an optimisation: a failure must not stop serving
                    log.error("prefetching the frame set at %d failed: %s", frame_set.newest_ns, traceback.format_exc())
        return self.standing.next_job(stop) if self.standing.active and not stop() else None

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
            "frames_window_evictions": dict(self.frames.window_evictions),   # left frame_window_s
            "frames_held_window_ns": self.frames.held_window_ns(),            # the stamps each camera's frames span
            # answered queries a follow-up may name now (serving.conversations at most)
            "conversations": len(self.pipeline.rt.conversations.turns) if self.pipeline is not None else 0,
            "explanations": self.explainer.stats() if self.explainer is not None else None,
            "standing": self.standing.stats(),
            "views_encoded": self.views_encoded,
            "views_reused": self.views_reused,
            "following_frames": self.ticking(),      # the idle worker prefetches new frame sets (idle_job)
            "frame_delay_ms": ((percentile(self.frame_delay_ms, 50), percentile(self.frame_delay_ms, 90))
                               if len(self.frame_delay_ms) else (0.0, 0.0)) + (len(self.frame_delay_ms),),
        }
