"""The query server's worker with in-flight batching (serving.max_batch > 1; batching.py).

One loop on the worker thread: take queued requests while the batch has a free region (blocking
only when nothing runs), admit each (deadline check, then every stage up to prefill: errors are
answered at once), run one decode pass over the batch, and publish each query that finished in
it at once, without waiting for the others. A query running alone decodes as an unbatched one
(EAGLE-2 where chosen) until a request is waiting for a free region. When the batch is empty the
worker prefetches the frame set, as the one-at-a-time worker does.

Every request still gets exactly one record (QueryServer._answer); shutdown answers the requests
of a batch still running after drain_timeout_s (QueryServer._batch_running).
"""

from __future__ import annotations

import logging
import time
import traceback

from ..pipeline.batching import BatchDecoder

log = logging.getLogger("litevlm.server")


def work_batched(server, gc_clock) -> None:
    batch = BatchDecoder(server.pipeline)
    started: dict[int, tuple[int, int]] = {}        # id(request) -> (thread CPU ns, GC ns) at admission
    last = None
    waiting = lambda: batch.has_room and len(server.queue) > 0      # noqa: E731 - a query wants to join

    def admit(req) -> None:
        rec = server._starting(req)
        if rec.status != "ok":
            server._answer(req, rec)
            return
        started[id(req)] = (time.thread_time_ns(), gc_clock.total_ns)
        server._batch_running.append(req)           # running from here on (a drain may give up on it)
        try:
            batch.admit(server._images(req), req.text, on_tokens=server._partials_of(req), tag=(req, rec),
                        **req.pipeline_arguments())
        except Exception as exc:  # noqa: BLE001 - a failing query must not stop the server
            started.pop(id(req), None)
            server._batch_running.remove(req)
            server._answer(req, server._failed(req, rec, exc))

    def publish(done) -> None:
        for running, ans in done:
            req, rec = running.tag
            cpu0, gc0 = started.pop(id(req), (time.thread_time_ns(), gc_clock.total_ns))
            rec.cpu_ms, rec.gc_ms = (time.thread_time_ns() - cpu0) / 1e6, (gc_clock.total_ns - gc0) / 1e6
            server._batch_running.remove(req)
            server._answer(req, server._answered(rec, ans))

    while not server._stop.is_set():
        if not len(batch):
            req = server.queue.get(timeout=0.2)
            if req is None:
                continue
            admit(req)
            last = req
        while batch.has_room and len(server.queue) and not server._stop.is_set():
            req = server.queue.get(timeout=0)
            if req is not None:
                admit(req)
                last = req
        try:
            publish(batch.step(waiting))
        except Exception as exc:  # noqa: BLE001 - every query of the failed step gets the error
            log.error("batched step failed: %s", traceback.format_exc())
            for running in list(batch.running):
                req, rec = running.tag
                server._batch_running.remove(req)
                server._answer(req, server._failed(req, rec, exc))
            batch = BatchDecoder(server.pipeline)
            continue
        if not len(batch) and last is not None and not server._stop.is_set():
            server.prefetch(last)
            last = None
    while len(batch):           # stopping: the running queries finish (queued ones are the server's to answer)
        publish(batch.step())
    publish(batch.step())
