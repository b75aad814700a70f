"""The node's process: start it with its command-line arguments, spin, and end it cleanly.

    run_node(args)      spin until SIGINT / SIGTERM / lifecycle `shutdown`, then drain and exit
    main()              `litevlm_drive_node`, the executable launch_ros starts

The executor is multi-threaded so that the lifecycle and parameter services answer while a
transition runs (configure loads and warms the model up for seconds): the lifecycle services are
in a reentrant callback group of their own (node.py), everything else in the node's default,
mutually exclusive one, so the node's own callbacks never run concurrently with each other.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
import traceback

import rclpy
from rclpy.duration import Duration
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.signals import SignalHandlerOptions

from .dds_env import use_profile_memory_policy
from .node import DriveNode
from .parameters import NODE_NAME
from .topics import SHIPPED_REMAPS

M_ARENA_MAX = -8          # mallopt's parameter number (glibc malloc.h)
MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
    """At most `arenas` glibc malloc arenas for the process. The executor's threads take turns
    running callbacks; each thread that allocates gets its own arena by default (up to 8 per
    core), and a configure on one thread freed by a cleanup on another left memory parked in
    arenas: RSS grew 2 MB per lifecycle cycle (tests/test_ros_memory.py, 521 -> 565 MB over 20
    cycles; flat with one arena). Called before any thread of ours starts. A no-op off glibc."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return                                   # the user's choice wins
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            ctypes.CDLL(libc).mallopt(M_ARENA_MAX, arenas)
        except (OSError, AttributeError):
            pass

# A second SIGINT this soon after the first is the same Ctrl-C, forwarded by ros2 launch.
REPEATED_SIGINT_S = 1.0
# Executor threads: a transition, the lifecycle/parameter services beside it, the node's callbacks.
EXECUTOR_THREADS = 4


def ros_arguments(params_file=None, overrides: dict | None = None, namespace: str = "",
                  remaps=(), log_level: str = "") -> list[str]:
    """The `--ros-args` of `litevlm drive`: the namespace, the user's remaps, then the shipped
    ones (rcl uses the first rule that matches, so the user's win), the params file, `-p`s."""
    args = ["--ros-args"]
    if namespace:
        args += ["-r", f"__ns:={'/' + namespace.strip('/')}"]
    for rule in [*remaps, *(f"{src}:={dst}" for src, dst in SHIPPED_REMAPS)]:
        args += ["-r", rule]
    if params_file:
        args += ["--params-file", str(params_file)]
    for k, v in (overrides or {}).items():
        args += ["-p", f"{k}:={v}"]
    if log_level:
        args += ["--log-level", log_level]
    return args


def drain_and_close(node: DriveNode, executor, ack_timeout_s: float = 2.0) -> None:
    """Shut down without losing an answer: the server stops intake and drains (bounded by
    drain_timeout_s) while the executor keeps spinning, so a query still arriving is answered
    shutting_down; then the answer publishers wait (bounded) for their subscribers to
    acknowledge, and only then does the context go."""
    drained = threading.Event()
    threading.Thread(target=lambda: (node.server.shutdown(), drained.set()), name="litevlm-drain").start()
    while not drained.is_set() and executor.context.ok():
        executor.spin_once(timeout_sec=0.05)
    drained.wait()
    for pub in node.answer_publishers():
        if executor.context.ok() and not pub.wait_for_all_acked(Duration(seconds=ack_timeout_s)):
            node.get_logger().warning(
                f"{pub.topic_name}: not every subscriber acknowledged within {ack_timeout_s:.0f} s"
            )
    node.log_summary()
    executor.remove_node(node)
    executor.shutdown()
    node.destroy_node()
    if rclpy.ok():
        rclpy.shutdown()


def stop_on_signals(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set `stop` (the node drains, then exits); a later one ends the process at
    once. rclpy's own handlers would shut the context down on the signal, before the worker could
    publish what it owes ("publisher's context is invalid"): the node handles both itself."""
    first_signal = [0.0]

    def on_signal(signum, frame):
        now = time.monotonic()
        if not stop.is_set():
            first_signal[0] = now
            stop.set()
        elif signum == signal.SIGINT and now - first_signal[0] < REPEATED_SIGINT_S:
            # Ctrl-C under `ros2 launch` reaches the node twice: from the terminal (the process
            # group) and from launch, which forwards it. That second one is the same request.
            return
        else:
            signal.signal(signum, signal.SIG_DFL)      # a later one ends the process at once
            os.kill(os.getpid(), signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def drive_lifecycle(node: DriveNode) -> None:
    """configure, then activate when it succeeded (what the launch file requests), off the
    executor's threads: the services answer meanwhile."""
    node.trigger_configure()
    if node.state == "inactive":
        node.trigger_activate()
    node.get_logger().info(f"ready ({node.state})")


def spin_once_surviving_callbacks(node: DriveNode, executor) -> None:
    """One spin of the executor. rclpy's MultiThreadedExecutor re-raises a callback's exception
    in spin_once, which would end the node (drain, exit) on the first bug in any timer or
    subscription callback, with every later query unanswered: the exception is logged with its
    traceback and counted on /diagnostics, and the node goes on serving."""
    try:
        executor.spin_once(timeout_sec=0.1)
    except ExternalShutdownException:
        raise
    except Exception as exc:  # noqa: BLE001 - any callback's: logged, counted, serving goes on
        node.callback_errors += 1
        node.last_callback_error = f"{type(exc).__name__}: {exc}"
        node.get_logger().error("a callback raised; the node goes on serving:\n" + traceback.format_exc())


def run_node(args: list[str], node_name: str = NODE_NAME, self_drive: bool = True) -> int:
    """Start the node with these command-line arguments and spin until SIGINT or SIGTERM, or until
    a lifecycle `shutdown` finalized it; then drain (drain_and_close) and end the process. With
    self_drive (`litevlm drive`) the node takes itself through configure and activate, as the launch
    file does under `ros2 launch`. A failed configure keeps the node up: it answers every query
    with an error and reports the cause on /diagnostics."""
    use_profile_memory_policy()
    limit_malloc_arenas()
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    stop_on_signals(stop)
    node = DriveNode(node_name)
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    executor.add_node(node)
    try:
        if self_drive:
            threading.Thread(target=drive_lifecycle, args=(node,), name="litevlm-lifecycle", daemon=True).start()
        while not stop.is_set() and not node.finalized.is_set() and executor.context.ok():
            spin_once_surviving_callbacks(node, executor)
            node.between_spins()
        why = "finalized (lifecycle shutdown)" if node.finalized.is_set() else "signal"
        node.get_logger().info(f"stopping: draining the request queue ({why})")
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        drain_and_close(node, executor)
    # Everything owed is done: answers acknowledged, summary logged, the DDS participant gone.
    # The interpreter's own teardown (torch, OpenMP, a large heap) then took 4-5 s here, which
    # under `ros2 launch` runs into its 5 s sigint_timeout and a SIGTERM ("process has died").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    """`litevlm_drive_node`: the executable launch_ros starts (lib/litevlm/litevlm_drive_node).
    Transitions come from the launch file or `ros2 lifecycle set`; names, remaps, parameters and
    the DDS profile are entirely the caller's (no shipped remap is added here)."""
    return run_node(sys.argv, self_drive=False)
