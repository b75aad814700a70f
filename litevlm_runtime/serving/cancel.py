"""A cancellable piece of work (the node's configure: loading a model and warming it up).

    scope = CancelScope()
    pipe = scope.run(load)         # load() on a thread of its own; raises Cancelled(reason) when cancelled
    scope.cancel("SIGINT")         # from any other thread; True when a run was interrupted

Why not a flag the loaders check: configure spends its seconds in many places (safetensors shards,
the finite check, module construction, engine set-up, the warm-up query's vision, prefill and
decode, the speculation cost table), most of them long C calls (torch ops, file reads) under code
this module does not own; a flag checked "between shards and stages" would miss a 2B model's
warm-up, which is one stage of tens of seconds on a CPU. So `cancel` raises an exception in the
working thread itself (CPython's PyThreadState_SetAsyncExc): it takes effect at that thread's next
Python bytecode, i.e. as soon as the torch op or read it is in returns (a few hundred ms at most
for a 2B model's largest op here). The exception is a BaseException, so that the loaders'
`except Exception` handlers do not swallow it; the caller gets `Cancelled`, an ordinary exception.

Why the work runs on a thread of its own: an interrupt fires at whatever bytecode comes next, and
no Python code can close the gap between the moment one fires and the moment the target stops
being interrupted, since that code is bytecodes too. A second interrupt sent while the first
unwinds (a 2B checkpoint's 13 GB freed on the way out holds the GIL for seconds; the canceller
asks every 50 ms) landed in the scope's own exit in 3 of 4 runs of a lifecycle shutdown during
configure, escaped the node's `except Cancelled`, and rclpy, which catches `Exception` only, left
the node in `configuring` for good (and a third one killed the executor thread it landed in). On a
thread that runs nothing but the work, wherever an interrupt lands it ends only that thread; the
caller waits for the thread to end and reads what it left, so the caller's code is never reached.

Whatever the interrupted work was building is left half-built and dropped: only work whose partial
results are garbage (a model being loaded) belongs in a scope.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")

# How long after an interrupt `cancel` sends another, for a work thread that dropped it (a bare
# `except BaseException` in a library, or a __del__ it landed in): one interrupt at a time, so that a
# library's cleanup on the way out (a lock's release in a `finally`) is not cut short by the next;
# inside the node's 1 s wait for a configure to give up (ros/node.py, CONFIGURE_GIVE_UP_S).
RESEND_S = 0.5


class Cancelled(Exception):
    """The work of a CancelScope was cancelled; str() is the reason given to `cancel`."""


class _Interrupt(BaseException):
    """Raised asynchronously inside the work thread (BaseException: not caught by `except Exception`)."""


def _quiet_unraisable(hook):
    """An interrupt that lands in code whose exceptions Python cannot raise (a gc callback, a
    __del__) is reported as "Exception ignored in ..." with a traceback and dropped; the canceller
    sends another (cancel_and_wait), so that one is dropped quietly."""
    def quiet(unraisable):
        if unraisable.exc_type is not _Interrupt:
            hook(unraisable)
    return quiet


def _quiet_thread_end(hook):
    """A work thread ended by an interrupt outside the work (after it returned, before the thread
    ended) is not an error: its outcome is already decided (run)."""
    def quiet(args):
        if args.exc_type is not _Interrupt:
            hook(args)
    return quiet


sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
threading.excepthook = _quiet_thread_end(threading.excepthook)


def _raise_in(thread_id: int, exc_type: type | None) -> None:
    """Make `thread_id` raise `exc_type` at its next bytecode (None: clear what is pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type is not None else None)


class CancelScope:
    def __init__(self):
        self._lock = threading.Lock()
        self._thread: int | None = None      # the work thread of the run in progress, once it started
        self._running = False                # a run is in progress (between run's start and its return)
        self.reason = ""                     # why it was cancelled ("": it was not)
        self.started = 0.0                   # monotonic time the current run began
        self._sent_at = float("-inf")        # monotonic time of the current run's last interrupt
        self._abandoned = False              # run returns without waiting for its work thread (abandon)
        self.done = threading.Event()        # set when no run is in progress
        self.done.set()

    @property
    def active(self) -> bool:
        return not self.done.is_set()

    def run(self, work: Callable[[], T], name: str = "litevlm-cancellable") -> T:
        """work() on a thread of its own, this thread waiting for it: its result, its exception, or
        Cancelled when `cancel` came before it ended (a result it finished meanwhile is dropped).
        A scope runs one piece of work at a time; a new run starts uncancelled."""
        with self._lock:
            if self._running:
                raise RuntimeError("CancelScope.run: a run is already in progress")
            self._running, self._thread, self.reason, self._abandoned = True, None, "", False
            self.started, self._sent_at = time.monotonic(), float("-inf")
            self.done.clear()
        outcome: dict = {}

        def on_work_thread():
            with self._lock:
                self._thread = threading.get_ident()
                if self.reason:          # cancelled before it began
                    return
            try:
                outcome["result"] = work()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, _Interrupt included
                outcome["error"] = exc

        worker = threading.Thread(target=on_work_thread, name=name, daemon=True)
        try:
            worker.start()
            while worker.is_alive() and not self._abandoned:
                worker.join(0.05)    # in slices: a signal's handler on this thread still runs
        finally:
            with self._lock:
                self._thread, self._running = None, False
                cancelled = self.reason
            self.done.set()
        if cancelled:
            raise Cancelled(cancelled)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def cancel(self, reason: str) -> bool:
        """Interrupt the run in progress (False: none is). Safe to call again, and often: a work
        thread that caught and dropped the interrupt gets another RESEND_S after it, never sooner."""
        with self._lock:
            if not self._running:
                return False
            if self._thread == threading.get_ident():
                raise RuntimeError("CancelScope.cancel: called from the work thread it would interrupt")
            self.reason = self.reason or reason
            now = time.monotonic()
            if self._thread is not None and now - self._sent_at >= RESEND_S:
                self._sent_at = now
                _raise_in(self._thread, _Interrupt)
            return True

    @property
    def abandoned(self) -> bool:
        """The last run returned without waiting for its work thread (abandon)."""
        return self._abandoned

    def abandon(self) -> bool:
        """After `cancel`: the run returns Cancelled now, without waiting for its work thread, which
        is still inside one call (its interrupt fires when the call returns, and ends it; a daemon
        thread, it ends with the process). For a stop that must not wait on that call: the process is
        ending. False where no cancelled run is in progress."""
        with self._lock:
            if not (self._running and self.reason):
                return False
            self._abandoned = True
            return True

    def cancel_and_wait(self, reason: str, timeout_s: float, poll_s: float = 0.05, between=None) -> bool:
        """cancel(), repeated every `poll_s` until the run has ended or `timeout_s` passed
        (`between()`: called in each wait, e.g. to spin an executor). True when it ended."""
        end = time.monotonic() + timeout_s
        while self.active and time.monotonic() < end:
            self.cancel(reason)
            if between is not None:
                between()
            self.done.wait(poll_s)
        return not self.active
