"""Explanations of answered queries, computed after their answers are published (docs/explain.md).

Which queries are explained (`wants`, at submission; the server's `explain` setting):

    never        none, whatever a query asks
    subscribed   (default) a query that asks (QueryRequest.explain, Query.msg `explain`), and every
                 query while someone subscribes to the explanations (the node: ~/explanation)
    always       every query
(Not off/on: YAML and `ros2 param set` read those as booleans, and the parameter is a string.)

An explained query's Answer carries its trace, taken right after its prefill (Pipeline.begin:
a clone of the prompt's embeddings and rows; nothing else runs for it before the answer). Once
the server has delivered its answer record, the trace comes here: the Explainer computes the
explanation (pipeline/explanation.py: view probabilities, token scores, the extra attention pass),
draws the rig picture as JPEG when asked to (explain/picture.py), and hands them to `publish`.
On its own thread (the node): the answer is out first and its latency holds none of this; the
next query shares the CPU with it. At most `depth` wait (each holds its query's frames and a copy of
its prompt's embeddings: tens of MB for InternVL2.5-2B with raw frames); when more come, the oldest
waiting is dropped (counted, logged): explaining never holds answers back. Inline (`threaded=False`): `bag
eval`, which writes them into an MCAP as the answers come.

A query that is not explained runs none of this: the check of `wants` is the only cost.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

from ..errors import InputError
from ..explain.picture import draw_explanation, encode_jpeg
from ..pipeline.explanation import Explanation, QueryTrace, explain
from ..pipeline.request import QueryRequest
from ..timing import percentile
from .record import AnswerRecord

log = logging.getLogger("litevlm.server")

# The parts of an explanation's cost, in the order they run (ms each; explanation.py's three, then the picture's).
PARTS = ("views", "token_scores", "attention", "draw", "jpeg")


def wants(mode: str, request: QueryRequest, subscribed: Callable[[], bool]) -> bool:
    """Whether a query is to be explained under the `explain` setting `mode` (`subscribed()`: whether
    anyone takes the explanations now; called only in mode subscribed, for a query that does not ask)."""
    if mode == "never":
        return False
    return mode == "always" or request.explain or subscribed()


@dataclass
class Explained:
    """One explained answer, as `publish` receives it."""
    record: AnswerRecord
    explanation: Explanation
    images: dict                        # camera -> what the query was given (None: absent or undecodable)
    picture: bytes | None               # the rig picture as JPEG (Explainer(picture=True)), else None
    cost_ms: dict[str, float] = field(default_factory=dict)    # per part of PARTS that ran


class Explainer:
    def __init__(self, publish: Callable[[Explained], None], picture: bool = True, threaded: bool = True,
                 depth: int = 4, width: int = 1440, jpeg_quality: int = 85):
        self.publish, self.picture, self.threaded = publish, picture, threaded
        self.depth, self.width, self.quality = depth, width, jpeg_quality
        self._jobs: deque = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()          # the running thread's own (a stopped one may still be finishing)
        self._busy = False
        self.explained = self.dropped = self.failed = 0
        self.cost_ms: dict[str, deque] = {p: deque(maxlen=1000) for p in (*PARTS, "total")}

    # ---- intake (the server's worker thread) ----
    def submit(self, rt, record: AnswerRecord, trace: QueryTrace, images: Mapping) -> None:
        """Explain one delivered answer (its runtime, record, trace and the images it was given):
        now (inline), or queued for the explainer's thread."""
        job = (rt, record, trace, images)
        if not self.threaded:
            self._run(job)
            return
        with self._cv:
            if len(self._jobs) >= self.depth:
                old = self._jobs.popleft()
                self.dropped += 1
                log.warning("%s: explanation dropped (%d waiting: explaining is slower than answering)",
                            old[1].query_id, self.depth)
            self._jobs.append(job)
            self._cv.notify()

    # ---- the thread ----
    def start(self) -> None:
        if self.threaded and self._thread is None:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._loop, args=(self._stop,), name="litevlm-explainer",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish the explanations waiting (for at most `timeout_s`), then stop; those left are dropped."""
        thread = self._thread
        if thread is None:
            return
        end = time.monotonic() + timeout_s
        with self._cv:
            while (self._jobs or self._busy) and time.monotonic() < end:
                self._cv.wait(max(0.0, min(0.05, end - time.monotonic())))
            self.dropped += len(self._jobs)
            self._jobs.clear()
            self._stop.set()
            self._cv.notify_all()
        thread.join(max(0.0, end - time.monotonic()) + 1.0)
        self._thread = None

    def idle(self) -> bool:
        with self._cv:
            return not self._jobs and not self._busy

    def _loop(self, stop: threading.Event) -> None:
        while True:
            with self._cv:
                while not self._jobs and not stop.is_set():
                    self._cv.wait()
                if stop.is_set():
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._run(job)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    # ---- one explanation ----
    def _run(self, job) -> None:
        rt, record, trace, images = job
        try:
            done = self.explain_one(rt, record, trace, images)
            self.publish(done)
        except Exception:  # noqa: BLE001 - an explanation is a courtesy: its failure must not stop serving
            self.failed += 1
            log.error("explaining %s failed: %s", record.query_id, traceback.format_exc())
            return
        self.explained += 1
        for part, ms in done.cost_ms.items():
            self.cost_ms[part].append(ms)
        self.cost_ms["total"].append(sum(done.cost_ms.values()))

    def explain_one(self, rt, record: AnswerRecord, trace: QueryTrace, images: Mapping) -> Explained:
        explanation = explain(rt, trace)
        cost = dict(explanation.cost_ms)
        frames = readable(images, rt.options.cameras)
        picture = None
        if self.picture:
            t0 = time.perf_counter()
            drawn = draw_explanation(explanation, frames, self.width)
            t1 = time.perf_counter()
            picture = encode_jpeg(drawn, self.quality)
            cost.update(draw=(t1 - t0) * 1000, jpeg=(time.perf_counter() - t1) * 1000)
        return Explained(record, explanation, frames, picture, cost)

    def stats(self) -> dict:
        """Counts and the median cost per part (ms) of the explanations so far (the last 1000)."""
        with self._cv:
            waiting = len(self._jobs)
        return {"explained": self.explained, "dropped": self.dropped, "failed": self.failed, "waiting": waiting,
                "cost_ms_p50": {p: percentile(v, 50) for p, v in self.cost_ms.items() if len(v)}}


def readable(images: Mapping, cameras) -> dict:
    """camera -> its image as the query was given it, None where a camera has none or it cannot be
    read (a camera the view selector dropped may carry a broken frame: drawn as an empty panel)."""
    out = {}
    for camera in cameras:
        try:
            out[camera] = images[camera] if camera in images else None
        except InputError:
            out[camera] = None
    return out
