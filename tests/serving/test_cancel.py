"""serving/cancel.py: a configure's load interrupted from another thread ends as one Cancelled, however
often the canceller asks (the node's waits re-ask every 50 ms, a stop's every executor slice), and
nothing reaches the thread once its scope has ended. Behaviour only: no figure here depends on the
machine's speed (the waits are generous bounds, not measurements)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from litevlm_runtime.serving import cancel
from litevlm_runtime.serving.cancel import Cancelled, CancelScope


def run_in_thread(body, scope: CancelScope) -> tuple[threading.Thread, dict]:
    """scope.run(body) called from a thread of its own (as the node's executor thread calls it); what
    the call ended with in the dict."""
    out: dict = {}

    def caller():
        try:
            out["result"] = scope.run(body)
            out["ended"] = "normally"
        except Cancelled as exc:
            out["ended"], out["reason"] = "cancelled", str(exc)
        except BaseException as exc:  # noqa: BLE001 - what the test is about: nothing else escapes
            out["ended"] = f"escaped: {type(exc).__name__}"

    t = threading.Thread(target=caller, daemon=True)
    t.start()
    end = time.monotonic() + 10
    while not scope.active and t.is_alive() and time.monotonic() < end:
        time.sleep(0.001)
    return t, out


def spam(scope: CancelScope, stop: threading.Event, reason: str = "test") -> None:
    """Ask for the cancel as fast as a thread can, until `stop`."""
    while not stop.is_set():
        scope.cancel(reason)


def load_like(began: threading.Event):
    """What a model load looks like to an interrupt: big tensors held in a frame (freeing them on the
    way out takes the GIL for milliseconds, and a waiting canceller gets it right after), waits in
    C calls that release the GIL."""
    def build():
        buffers = [torch.ones(32 << 20) for _ in range(4)]     # 512 MB, touched
        began.set()
        for _ in range(3000):
            time.sleep(0.01)
        return buffers
    return build


@pytest.mark.parametrize("resend_s", [cancel.RESEND_S, 0.0], ids=["one at a time", "every ask"])
def test_work_cancelled_by_a_canceller_asking_nonstop_ends_cancelled_never_with_the_raw_interrupt(resend_s,
                                                                                                   monkeypatch):
    monkeypatch.setattr(cancel, "RESEND_S", resend_s)    # every ask: interrupts landing in the unwinding too
    # A second interrupt that fired while the first unwound, at the scope's exit's first bytecode,
    # escaped the node's `except Cancelled` (its configure never finished): the work's own thread
    # takes them all.
    for _ in range(6):
        scope = CancelScope()
        stop = threading.Event()
        began = threading.Event()
        t, out = run_in_thread(load_like(began), scope)
        assert began.wait(10)
        canceller = threading.Thread(target=spam, args=(scope, stop, "lifecycle shutdown"), daemon=True)
        canceller.start()
        t.join(10)
        stop.set()
        canceller.join(10)
        assert out == {"ended": "cancelled", "reason": "lifecycle shutdown"}
        assert not scope.active and scope.cancel("late") is False


def test_a_body_that_drops_the_first_interrupt_gets_another():
    scope = CancelScope()
    dropped, began = [], threading.Event()

    def swallows_once():
        began.set()
        try:
            for _ in range(500):
                time.sleep(0.01)
        except BaseException:  # noqa: BLE001 - a library's bare handler, as the module's docstring says
            dropped.append(True)
        for _ in range(3000):   # interrupted again, later
            time.sleep(0.01)

    t, out = run_in_thread(swallows_once, scope)
    assert began.wait(10)
    assert scope.cancel_and_wait("SIGINT", timeout_s=20) is True
    t.join(10)
    assert dropped == [True] and out == {"ended": "cancelled", "reason": "SIGINT"}


def test_the_callers_thread_is_never_interrupted_and_nothing_reaches_it_after_the_run():
    scope = CancelScope()
    stop = threading.Event()
    after: dict = {}
    began = threading.Event()

    def caller():
        try:
            try:
                scope.run(load_like(began))
            except Cancelled:
                after["cancelled"] = True
            end = time.monotonic() + 0.5          # the caller's own code, while a canceller still asks
            while time.monotonic() < end:
                sum(range(100))
            after["ok"] = True
        except BaseException as exc:  # noqa: BLE001
            after["escaped"] = type(exc).__name__

    t = threading.Thread(target=caller, daemon=True)
    t.start()
    assert began.wait(10)
    canceller = threading.Thread(target=spam, args=(scope, stop), daemon=True)
    canceller.start()
    t.join(20)
    stop.set()
    canceller.join(10)
    assert after == {"cancelled": True, "ok": True}


def test_results_and_errors_of_work_that_was_not_cancelled_come_back_as_they_are():
    scope = CancelScope()
    assert scope.run(lambda: 42) == 42
    with pytest.raises(ValueError, match="bad checkpoint"):
        scope.run(lambda: (_ for _ in ()).throw(ValueError("bad checkpoint")))
    assert not scope.active and scope.cancel("late") is False


def test_a_scope_runs_one_piece_of_work_at_a_time_and_a_new_run_starts_uncancelled():
    scope = CancelScope()
    release = threading.Event()
    t, out = run_in_thread(lambda: release.wait(10), scope)
    with pytest.raises(RuntimeError, match="already in progress"):
        scope.run(lambda: None)
    release.set()
    t.join(10)
    assert out == {"ended": "normally", "result": True}

    def cancels_itself():
        scope.cancel("self")
    with pytest.raises(RuntimeError, match="called from the work thread"):
        scope.run(cancels_itself)
    t, out = run_in_thread(lambda: [time.sleep(0.01) for _ in range(3000)], scope)
    assert scope.cancel_and_wait("first", timeout_s=20)
    t.join(10)
    assert out == {"ended": "cancelled", "reason": "first"}
    t, out = run_in_thread(lambda: time.sleep(0.05), scope)
    t.join(10)
    assert out == {"ended": "normally", "result": None} and scope.reason == ""


def test_abandoned_work_stuck_in_one_call_lets_the_caller_go_on_at_once():
    scope = CancelScope()
    assert scope.abandon() is False                       # nothing running, nothing cancelled
    began = threading.Event()
    t, out = run_in_thread(lambda: (began.set(), time.sleep(3)), scope)   # one C call, 3 s long
    assert began.wait(10)
    assert scope.abandon() is False                       # not cancelled: a run is not abandoned unasked
    assert scope.cancel_and_wait("SIGINT", timeout_s=0.3) is False
    assert scope.abandon() is True
    t.join(10)
    assert out == {"ended": "cancelled", "reason": "SIGINT"} and not scope.active
