"""The request queue: queries accepted by the server, waiting for the pipeline worker, served by
priority (Query.priority, higher first), then in arrival order.

Overflow policy when it is full (`queue_size`):
  reject_new   (default) a query arriving at a full queue is answered queue_full; queued queries
               keep their place (first come, first served)
  drop_oldest  the oldest queued query of the lowest priority is answered queue_full and the new
               one is queued (freshest questions win; useful when only the latest question matters)
Under either policy a query that outranks a queued one is never refused for it: the newest queued
query of the lowest priority makes room (answered queue_full), so a burst of low-priority
questions cannot keep a high-priority one out.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

from ..pipeline.request import QueryRequest
from .frame_store import FrameSet
from .images import FrameKeys

_arrivals = itertools.count()


@dataclass
class Queued:
    """A query the server accepted, on its way to its one answer: the request (checked once, at
    submit; never changed after), the frame set matched to it, and the server's bookkeeping."""
    request: QueryRequest
    received_ns: int
    frames: FrameSet | None = None   # None while it waits for frames (match_wait_s); the newest set (t-0)
    history: tuple[FrameSet, ...] = ()   # with frames K > 1: the K - 1 sets before it, oldest first
    standing: str = ""               # the standing question's name (standing.py), "" for an asked query
    answered: bool = False           # set once, under QueryServer's answer lock
    streamed: bool = False           # a partial answer was published: the last partial (final) must follow
    partial_tokens: int = 0          # tokens the last partial showed (a preempted query, run again, resumes there)
    arrival: int = field(default_factory=lambda: next(_arrivals))     # queue order among equal priorities

    @property
    def order(self) -> tuple[int, int]:
        """Its place in the queue: higher priority first, then earlier arrival."""
        return -self.request.priority, self.arrival

    @property
    def query_id(self) -> str:
        return self.request.query_id

    @property
    def sets(self) -> tuple[FrameSet, ...]:
        """Its frame sets, oldest first, the newest (`frames`) last."""
        return (*self.history, self.frames)

    @property
    def frame_keys(self) -> FrameKeys:
        """What identifies its frames: later questions about them reuse their visual features;
        a follow-up names the frames of the turn it follows."""
        return FrameKeys(self.frames.frames)


class RequestQueue:
    """Bounded, ordered by (priority, arrival), with the overflow policy above. queue.Queue can
    neither order by priority with a bound nor evict a chosen item atomically, hence this class
    (the queue holds at most queue_size items: a list kept in order is enough)."""

    def __init__(self, size: int, policy: str):
        self.size, self.policy = size, policy
        self._items: list[Queued] = []          # in serving order
        self._cond = threading.Condition()
        self._closed = False

    def _insert(self, req: Queued) -> None:
        at = next((i for i, other in enumerate(self._items) if req.order < other.order), len(self._items))
        self._items.insert(at, req)
        self._cond.notify()

    def put(self, req: Queued) -> Queued | None:
        """Queue `req`; returns the request that was refused (req, or the one evicted for it) or None."""
        with self._cond:
            if self._closed:
                return req
            refused = None
            if len(self._items) >= self.size:
                lowest = min(r.request.priority for r in self._items)
                if req.request.priority > lowest:      # outranks the queue's lowest: its newest makes room
                    refused = max((r for r in self._items if r.request.priority == lowest), key=lambda r: r.arrival)
                elif self.policy == "reject_new":
                    return req
                else:                                  # drop_oldest, among the lowest priority
                    refused = min((r for r in self._items if r.request.priority == lowest), key=lambda r: r.arrival)
                self._items.remove(refused)
            self._insert(req)
            return refused

    def put_back(self, req: Queued) -> None:
        """A request taken out and not run to its end (a preempted query): back in its place,
        whatever the size (it was accepted once)."""
        with self._cond:
            self._insert(req)

    def get(self, timeout: float | None = None) -> Queued | None:
        with self._cond:
            if not self._items and not self._closed:
                self._cond.wait(timeout)
            return self._items.pop(0) if self._items else None

    def first_priority(self) -> int | None:
        """The priority of the request served next (None: empty)."""
        with self._cond:
            return self._items[0].request.priority if self._items else None

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take_expired(self, now_ns: int) -> list[Queued]:
        """Remove and return the queued requests whose deadline has passed."""
        with self._cond:
            expired = [r for r in self._items if r.request.deadline_ns and now_ns > r.request.deadline_ns]
            for r in expired:
                self._items.remove(r)
            return expired

    def drain(self) -> list[Queued]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def __len__(self) -> int:
        return len(self._items)
