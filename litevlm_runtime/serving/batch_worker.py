"""The query server's worker with in-flight batching (serving.max_batch > 1; pipeline/batching.py).

One loop on the worker thread (`BatchWorker.tick`): take queued requests, highest priority first,
while the batch has a free region (blocking only when nothing runs), admit each (deadline check,
then every stage up to prefill: errors are answered at once), run one decode pass over the batch,
and publish each query that finished in it at once, without waiting for the others. A query
running alone decodes as an unbatched one (EAGLE-2 where chosen) until a request is waiting.
When the batch is empty the worker prefetches the frame set, as the one-at-a-time worker does.

Whether a waiting query joins is the batching policy's (pipeline/batching.py BatchPolicy, the
server's `batch_policy`, kept across worker restarts): it measures the batched steps' cost per
token against a lone query's at the present load and, where batching does not pay (a CPU shared
with busy processes), runs one query at a time, trying a batch again now and then.

Priority: when every region is taken and the request served next outranks the lowest-priority
running query, that query (the latest admitted of the lowest priority) is preempted after the
current pass: its region is freed for the waiting one, and it goes back to the queue in its place
and runs again from its start later (vLLM's preemption by recomputation: its answer is the same,
greedy or seeded; its partial answers resume where they stopped). So a burst of low-priority
questions delays a high-priority one by at most one running pass.

Standing questions (standing.py) run at the lowest priority: one is admitted only when nothing
runs and no request is queued (QueryServer.idle_job hands it over), and as soon as a request is
queued, whatever the batching policy says, it stops after its current decode pass (a lone query's
decoding checks `waiting` between passes) and is preempted: it takes no region from the request and
runs again later from its start. An asked query thus waits at most one decode pass for it, or the
rest of its admission (view selection .. prefill) when one had begun.

Every request still gets exactly one record (QueryServer.deliver); shutdown answers the requests
of a batch still running after drain_timeout_s (QueryServer.running).
"""

from __future__ import annotations

import logging
import time
import traceback

from ..pipeline.batching import BatchDecoder, Running

log = logging.getLogger("litevlm.server")


class BatchWorker:
    def __init__(self, server, gc_clock):
        self.server, self.gc_clock = server, gc_clock
        self.policy = server.batch_policy
        self.batch = BatchDecoder(server.pipeline, self.policy)
        self.started: dict[int, tuple[int, int]] = {}      # id(request) -> (thread CPU ns, GC ns) at admission
        self.last = None                                   # the last request admitted (prefetch after it)

    def run(self) -> None:
        server = self.server
        while not server.stopping.is_set():
            self.tick()
        while len(self.batch):      # stopping: the running queries finish (queued ones are the server's to answer)
            self.publish(self.batch.step())
        self.publish(self.batch.step())

    def tick(self, timeout: float = 0.2) -> None:
        """One turn of the loop: admit what fits (waiting up to `timeout` for a request when nothing
        runs), preempt for a waiting request that outranks a running one, one decode pass, publish."""
        server, batch = self.server, self.batch
        self.yield_to_asked()
        if not len(batch):
            req = server.queue.get(timeout=0)
            if req is None:
                req = server.idle_job()          # prefetching new frame sets, and a standing question due
            if req is None:
                req = server.queue.get(timeout=server.idle_wait(timeout))
            if req is None:
                return
            self.admit(req)
        self.yield_to_asked()               # (a request that came during a standing question's admission)
        self.preempt_for_waiting()
        while batch.has_room and len(server.queue) and not server.stopping.is_set() and (
                not len(batch) or self.policy.batching):
            req = server.queue.get(timeout=0)
            if req is not None:
                self.admit(req)
        try:
            self.publish(batch.step(self.waiting))
        except Exception as exc:  # noqa: BLE001 - every query of the failed step gets the error
            log.error("batched step failed: %s", traceback.format_exc())
            for running in list(batch.running):
                req, rec = running.tag
                server.running.remove(req)
                server.deliver(req, server.failed(req, rec, exc))
            self.batch = BatchDecoder(server.pipeline, self.policy)
            return
        if not len(self.batch) and self.last is not None and not server.stopping.is_set():
            server.prefetch(self.last)
            self.last = None

    def waiting(self) -> bool:
        """Whether a queued request wants a region: a free one, or a running query's it outranks
        (a lone query then stops decoding alone after its current pass); always while a standing
        question runs."""
        first = self.server.queue.first_priority()
        if first is None:
            return False
        if any(r.tag[0].standing for r in self.batch.running):
            return True
        if not self.policy.batching:
            return False
        return self.batch.has_room or first > self.lowest_running()[0]

    def yield_to_asked(self) -> None:
        """Preempt every running standing question when a request is queued (it runs again later)."""
        server = self.server
        if not len(server.queue):
            return
        for r in [r for r in self.batch.running if r.tag[0].standing and not r.done]:
            req, _ = r.tag
            self.batch.preempt(r)
            self.started.pop(id(req), None)
            server.running.remove(req)
            server.standing.put_back(req)

    def lowest_running(self) -> tuple[int, Running | None]:
        """(priority, query) of the running query a waiting one would preempt: the lowest priority,
        the latest admitted among equals."""
        candidates = [r for r in self.batch.running if not r.done]
        if not candidates:
            return 1 << 30, None
        r = min(candidates, key=lambda r: (r.q.request.priority, -r.tag[0].arrival))
        return r.q.request.priority, r

    def preempt_for_waiting(self) -> None:
        server = self.server
        while not self.batch.has_room:
            first = server.queue.first_priority()
            priority, victim = self.lowest_running()
            if first is None or victim is None or first <= priority:
                return
            req, _ = victim.tag
            self.batch.preempt(victim)
            self.started.pop(id(req), None)
            server.running.remove(req)
            server.queue.put_back(req)
            log.info("%s (priority %d) preempted for a query of priority %d; it runs again later",
                     req.query_id, priority, first)

    def admit(self, req) -> None:
        server = self.server
        rec = server.leaving_queue(req)
        if rec.status != "ok":
            server.deliver(req, rec)
            return
        self.started[id(req)] = (time.thread_time_ns(), self.gc_clock.total_ns)
        server.running.append(req)            # running from here on (a drain may give up on it)
        try:
            images, keys = server.inputs(req)
            self.batch.admit(images, req.request, keys, on_tokens=server.partials_of(req), tag=(req, rec))
        except Exception as exc:  # noqa: BLE001 - a failing query must not stop the server
            self.started.pop(id(req), None)
            server.running.remove(req)
            server.deliver(req, server.failed(req, rec, exc))
            return
        if not req.standing:
            self.last = req

    def publish(self, done) -> None:
        server = self.server
        for running, ans in done:
            req, rec = running.tag
            cpu0, gc0 = self.started.pop(id(req), (time.thread_time_ns(), self.gc_clock.total_ns))
            rec.cpu_ms, rec.gc_ms = (time.thread_time_ns() - cpu0) / 1e6, (self.gc_clock.total_ns - gc0) / 1e6
            server.running.remove(req)
            server.deliver(req, rec.answered(ans))
            mode = self.policy.mode
            self.policy.answered()
            if self.policy.mode != mode:
                log.warning("batching: %s (%s)", self.policy.mode, self.policy.why)
