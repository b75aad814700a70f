"""A cancellable piece of work on one thread (the node's configure: loading a model and warming it up).

    scope = CancelScope()
    with scope.running():          # on the working thread: raises Cancelled(reason) when cancelled
        load()
    scope.cancel("SIGINT")         # from any other thread; True when a run was interrupted

Why not a flag the loaders check: configure spends its seconds in many places (safetensors shards,
the finite check, module construction, engine set-up, the warm-up query's vision, prefill and
decode, the speculation cost table), most of them long C calls (torch ops, file reads) under code
this module does not own; a flag checked "between shards and stages" would miss a 2B model's
warm-up, which is one stage of tens of seconds on a CPU. So `cancel` raises an exception in the
working thread itself (CPython's PyThreadState_SetAsyncExc): it takes effect at that thread's next
Python bytecode, i.e. as soon as the torch op or read it is in returns (a few hundred ms at most
for a 2B model's largest op here). The exception is a BaseException, so that the loaders'
`except Exception` handlers do not swallow it, and it is raised only while the thread is inside
`running()` (checked under a lock, and any exception still pending is cleared as the thread
leaves), so it never lands in the caller's code after the work ended. Inside, it converts to
`Cancelled`, an ordinary exception, for the caller to handle.

Whatever the interrupted work was building is left half-built and dropped: only work whose partial
results are garbage (a model being loaded) belongs in a scope.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from contextlib import contextmanager


class Cancelled(Exception):
    """The work of a CancelScope was cancelled; str() is the reason given to `cancel`."""


class _Interrupt(BaseException):
    """Raised asynchronously inside the working thread (BaseException: not caught by `except Exception`)."""


def _quiet_unraisable(hook):
    """An interrupt that lands in code whose exceptions Python cannot raise (a gc callback, a
    __del__) is reported as "Exception ignored in ..." with a traceback and dropped; the canceller
    sends another (cancel_and_wait), so that one is dropped quietly."""
    def quiet(unraisable):
        if unraisable.exc_type is not _Interrupt:
            hook(unraisable)
    return quiet


sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


def _raise_in(thread_id: int, exc_type: type | None) -> None:
    """Make `thread_id` raise `exc_type` at its next bytecode (None: clear what is pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type is not None else None)


class CancelScope:
    def __init__(self):
        self._lock = threading.Lock()
        self._thread: int | None = None      # the thread inside running(), if any
        self.reason = ""                     # why it was cancelled ("": it was not)
        self.started = 0.0                   # monotonic time the current run began
        self.done = threading.Event()        # set when no run is in progress
        self.done.set()

    @property
    def active(self) -> bool:
        return not self.done.is_set()

    @contextmanager
    def running(self):
        """Run the `with` body cancellably on this thread. A scope runs one body at a time; a new
        run starts uncancelled."""
        me = threading.get_ident()
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("CancelScope.running: already running on another thread")
            self._thread, self.reason, self.started = me, "", time.monotonic()
            self.done.clear()
        try:
            try:
                yield self
            finally:
                self._leave(me)
        except _Interrupt:
            raise Cancelled(self.reason or "cancelled") from None
        finally:
            self.done.set()

    def _leave(self, me: int) -> None:
        """No interrupt reaches this thread after this: none is sent once _thread is None, and
        the one still pending is cleared (it would fire in the caller's code). One that fires
        during this very cleanup is absorbed and the cleanup done again."""
        while True:
            try:
                with self._lock:
                    self._thread = None
                    _raise_in(me, None)
                return
            except _Interrupt:
                continue

    def cancel(self, reason: str) -> bool:
        """Interrupt the run in progress (False: none is). Safe to call again: a thread that
        caught and dropped the first interrupt (a bare `except BaseException`) gets another."""
        with self._lock:
            if self._thread is None:
                return False
            if self._thread == threading.get_ident():
                raise RuntimeError("CancelScope.cancel: called from the thread it would interrupt")
            self.reason = self.reason or reason
            _raise_in(self._thread, _Interrupt)
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
