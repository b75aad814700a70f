"""Standing questions: what a vehicle asks on every new frame set ("Is there a pedestrian in the ego
lane?", "Is the traffic light ahead red?"), answered only when the scene it is about changed.

Configured by the server's settings (settings.py: standing_questions 'NAME: QUESTION', standing_rate_hz,
standing_change, standing_frames; node parameters of the same names). At load each question's
cameras are the view selector's choice for it (pipeline.select_views: the cameras its answer reads),
and it asks for `standing_frames` frame sets (0: temporal.frames; the time selector may use fewer).

  offer(set)     every new final frame set (frame_store.py sets_after, in stamp order): a question
                 takes it when it is 1/standing_rate_hz after the last one it took (by stamps, with
                 the past-set tolerance for a rig's jitter), matched as an as_asked query stamped at
                 the set's newest frame would be (its past sets included); a newer set replaces one
                 still waiting, so a busy node answers the newest scene, not a backlog.
  next_job(stop) when the worker is idle: the first waiting question whose cameras changed, as a
                 queued request. Changed: the mean relative L2 distance of a camera's visual tokens
                 (stages/temporal.py token_change, the features the feature cache holds for the
                 frame: encoded here when the node has not prefetched them, interruptibly) against
                 those of the set it was last answered on, at least standing_change for one of its
                 cameras; a question never answered is answered. Unchanged: counted, not asked.
  answered(...)  its record: ok sets the reference features to the answered set's; published on
                 ~/standing/NAME stamped with the frames it used (the record's header stamp is the
                 set's newest frame's stamp, its frame stamps each camera's).

Priority: a standing question runs only while no asked query waits, alone in the batch decoder,
and is preempted after its current decode pass as soon as one arrives (batch_worker.py); it then
waits for the next idle moment and runs again from its start (the same answer). An asked query is
never refused for it (it takes no place in the request queue) and waits at most one decode pass,
or the rest of a standing question's prefill when one had begun (one forward pass over its prompt).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..errors import InputError
from ..pipeline.pipeline import select_views
from ..pipeline.request import QueryRequest
from ..stages.temporal import token_change
from .frame_store import PAST_TOLERANCE, FrameMatchError, FrameSet
from .images import CameraImages, FrameKeys
from .queue import Queued
from .settings import standing_questions

log = logging.getLogger("litevlm.server")


@dataclass
class StandingQuestion:
    name: str
    question: str
    cameras: list[str]                      # the view selector's choice: what a change is measured on
    frames: int                             # frame sets it asks for
    taken_ns: int | None = None             # the newest stamp of the last set it took
    waiting: Queued | None = None           # the newest set taken and not answered yet
    reference: dict = field(default_factory=dict)   # camera -> its visual tokens at the last answer
    compared: dict = field(default_factory=dict)    # camera -> those of the set being answered
    seq: int = 0
    answered: int = 0                       # answers published (ok)
    unchanged: int = 0                      # sets taken and not asked: no camera changed enough
    preempted: int = 0                      # runs given up for an asked query (run again later)
    unmatched: int = 0                      # sets whose frame sets over time could not be matched
    errors: int = 0                         # error answers published
    replaced: int = 0                       # waiting sets replaced by a newer one before they ran
    last_change: float = float("nan")       # the largest camera change at the last comparison
    last_error: str = ""


class Standing:
    def __init__(self, server, publish):
        self.server = server
        self.publish = publish                  # (name, AnswerRecord) -> None: ~/standing/NAME
        self.questions: dict[str, StandingQuestion] = {}
        self.cache = False                      # whether changes can be measured (serving.feature_cache)

    # ---- configuration (the server's load) ----
    def configure(self, pipeline) -> None:
        """The questions of the settings, for `pipeline` (None: none)."""
        settings = self.server.settings
        self.questions = {}
        if pipeline is None:
            return

        rt = pipeline.rt
        frames = settings.standing_frames or rt.options.temporal.frames
        for name, question in standing_questions(settings.standing_questions).items():
            QueryRequest(question, frames=frames).checked(rt, settings.max_question_chars)   # InputError naming it
            self.questions[name] = StandingQuestion(name, question, select_views(rt, question), frames)
        self.cache = rt.features is not None and rt.features.reuse

    @property
    def active(self) -> bool:
        return bool(self.questions) and self.server.settings.standing_rate_hz > 0

    # ---- new frame sets ----
    def offer(self, frame_set: FrameSet, now_ns: int) -> None:
        if not self.active:
            return
        period_ns = 1e9 / self.server.settings.standing_rate_hz
        stamp = frame_set.newest_ns
        for q in self.questions.values():
            if q.taken_ns is not None and stamp - q.taken_ns < period_ns * (1 - PAST_TOLERANCE):
                continue
            q.taken_ns = stamp
            try:
                sets = self.server.frames.match_over_time(now_ns, stamp, q.frames, self.server.stride_ns())
            except FrameMatchError as exc:
                q.unmatched += 1
                q.last_error = f"{exc.status}: {exc}"
                continue
            q.seq += 1
            request = QueryRequest(q.question, query_id=f"{q.name}#{q.seq}", stamp_ns=stamp, frames=q.frames)
            job = Queued(request, now_ns, frames=sets[-1], history=tuple(sets[:-1]), standing=q.name)
            if q.waiting is not None:
                q.replaced += 1
            q.waiting = job

    # ---- the idle worker ----
    def next_job(self, stop) -> Queued | None:
        """The first waiting question whose cameras changed (None: none, or `stop()` turned true while
        a camera was being encoded). Questions that did not change are dropped here, counted."""
        pipeline = self.server.pipeline
        if pipeline is None:
            return None
        for q in self.questions.values():
            job = q.waiting
            if job is None:
                continue
            if stop():
                return None
            features = self._features(pipeline, q, job, stop)
            if features is None:
                return None             # interrupted: it waits for the next idle moment
            change = max((float(token_change(features[c], q.reference[c]).mean()) for c in features
                          if c in q.reference), default=float("inf"))
            q.last_change = change
            q.waiting = None
            if q.reference and change < self.server.settings.standing_change and len(features) == len(q.reference):
                q.unchanged += 1
                continue
            q.compared = {c: f.clone() for c, f in features.items()}
            try:
                job.request = job.request.checked(pipeline.rt, self.server.settings.max_question_chars)
            except InputError as exc:        # (checked at configure: a runtime that changed since)
                q.errors += 1
                q.last_error = str(exc)
                continue
            return job
        return None

    def _features(self, pipeline, q: StandingQuestion, job: Queued, stop) -> dict | None:
        """camera -> the visual tokens of `q`'s cameras in the job's newest frame set, from the
        feature cache (encoded into it first where missing); {} without a cache (every set is
        then a change); None when `stop()` interrupted the encoding."""
        if not self.cache:
            return {}
        rt, frames = pipeline.rt, {c: job.frames.frames[c] for c in q.cameras}
        keys = FrameKeys(frames)
        images = CameraImages({c: f.payload for c, f in frames.items()}, rt.options.images.max_pixels)
        pipeline.prefetch(images, keys, stop=stop)
        out = {}
        for c in q.cameras:
            found = rt.features.get(c, keys[c])
            if found is None:
                if stop():
                    return None
                return {}        # (its image failed to decode: the question runs and says so)
            out[c] = found
        return out

    def put_back(self, job: Queued) -> None:
        """A running standing question preempted for an asked query: it waits again, unless a newer
        set was taken meanwhile."""
        q = self.questions.get(job.standing)
        if q is None:
            return
        q.preempted += 1
        if q.waiting is None:
            job.answered = False
            q.waiting = job

    def answered(self, job: Queued, rec) -> None:
        """The record of a standing question: published (ok and errors; not a stop's), and on ok its
        reference becomes the features it was answered on."""
        q = self.questions.get(job.standing)
        if q is None or rec.status in ("shutting_down", "not_active"):
            return
        if rec.status == "ok":
            q.answered += 1
            q.reference, q.compared = q.compared, {}
        else:
            q.errors += 1
            q.last_error = f"{rec.query_id}: {rec.status}: {rec.status_message}"
        try:
            self.publish(q.name, rec)
        except Exception:  # noqa: BLE001 - a failing publisher must not stop the worker
            log.exception("publishing standing answer %s failed", rec.query_id)

    # ---- diagnostics ----
    def stats(self) -> dict:
        return {name: {"question": q.question, "cameras": list(q.cameras), "frames": q.frames,
                       "answered": q.answered, "unchanged": q.unchanged, "preempted": q.preempted,
                       "unmatched": q.unmatched, "replaced": q.replaced, "errors": q.errors,
                       "last_change": q.last_change, "last_error": q.last_error}
                for name, q in self.questions.items()}
