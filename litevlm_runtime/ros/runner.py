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

from .dds_env import use_node_profile_if_none, use_profile_memory_policy
from .node import CONFIGURE_GIVE_UP_S, DriveNode
from .parameters import NODE_NAME
from .topics import SHIPPED_REMAPS

M_ARENA_MAX = -8          # mallopt's parameter number (glibc malloc.h)
MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
    """At most `arenas` glibc malloc arenas for the process. The executor's threads take turns
    running callbacks; each thread that allocates gets its own arena by default (up to 8 per
    core), and a configure on one thread freed by a cleanup on another left memory parked in
    arenas: RSS grew 2 MB per lifecycle cycle (tests/ros/test_ros_memory.py, 521 -> 565 MB over 20
    cycles; flat with one arena). Called before any thread of ours starts. A no-op off glibc."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return                                   # the user's choice wins
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            ctypes.CDLL(libc).mallopt(M_ARENA_MAX, arenas)
        except (OSError, AttributeError):
            pass

# Executor threads: a transition, the lifecycle/parameter services beside it, the node's callbacks.
EXECUTOR_THREADS = 4
# The longest any wait of the main thread lasts: a signal's handler runs only on the main thread,
# between bytecodes, so a C call that blocks it (a DDS wait) delays the handler by its length.
SLICE_S = 0.05
# Of the drain's deadline (drain_timeout_s), what the running query leaves at least for the answers'
# acknowledgements.
ACK_RESERVE_S = 0.5
# After a lifecycle shutdown, how long the participant outlives the reply to `change_state`. A reply
# goes by shared memory from the node's own segment, which the participant's end removes: a client
# that had not opened that segment yet (a CLI just started, on a loaded machine) lost it in 1 of 3
# runs of `ros2 lifecycle set ... shutdown` during configure, and the CLI waited for ever. A
# service reply is not acknowledged to the server, so a short wait is all there is.
REPLY_GRACE_S = 0.3


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


class Signals:
    """What SIGINT and SIGTERM asked for (the handler sets it; the main thread acts on it).

    The first signal starts the stop. Under `ros2 launch` Ctrl-C reaches the node twice, from the
    terminal (the process group) and from launch, which forwards its own SIGINT 0.4-0.7 s later:
    the second SIGINT is that same request and the drain goes on, however late its handler runs
    (it used to be honoured only within 1 s of the first, and a drain blocked in a 2 s DDS wait
    ran it later: exit code -2). A SIGTERM after the first signal (launch's escalation after its
    5 s sigterm_timeout, or a user's `kill`) or a third SIGINT (Ctrl-C pressed again) cuts the
    drain short (`hurry`): the running query is answered shutting_down and the process ends
    within a slice, still with its summary. A signal after that ends the process at once."""

    def __init__(self):
        self.stop = threading.Event()
        self.hurry = threading.Event()
        self.first = ""                    # the first signal's name
        self.first_at = 0.0                # monotonic
        self.later: list[str] = []         # the names of the signals after it, in order
        self.logged = 0                    # how many of `later` the main thread has logged

    def handle(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if not self.stop.is_set():
            self.first, self.first_at = name, time.monotonic()
            self.stop.set()
            return
        if self.hurry.is_set():
            signal.signal(signum, signal.SIG_DFL)      # the drain was already cut short: end at once
            os.kill(os.getpid(), signum)
            return
        self.later.append(name)
        if name == "SIGTERM" or self.later.count("SIGINT") >= 2:
            self.hurry.set()

    def install(self) -> None:
        """rclpy's own handlers would shut the context down on the signal, before the worker could
        publish what it owes ("publisher's context is invalid"): the node handles both itself."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: self.handle(signum))

    def log_new(self, logger) -> None:
        """Log the signals that came since the last call (never from the handler: it may run
        inside the logger)."""
        for name in self.later[self.logged:]:
            if self.hurry.is_set():
                logger.warning(f"{name} again: the drain ends now (a further signal ends the process at once)")
            else:
                logger.info(f"{name} again (ros2 launch forwards the terminal's Ctrl-C): already stopping, the "
                            "drain goes on (Ctrl-C once more, or SIGTERM, ends it now)")
        self.logged = len(self.later)


class Drain:
    """One stop's deadline (drain_timeout_s from the first signal, or from now for a lifecycle
    shutdown) and the waits it bounds, each in SLICE_S slices so that a signal is handled at once."""

    def __init__(self, node: DriveNode, executor, signals: Signals):
        self.node, self.executor, self.signals = node, executor, signals
        start = signals.first_at if signals.stop.is_set() else time.monotonic()
        self.deadline = start + node.server.settings.drain_timeout_s

    def left(self) -> float:
        return 0.0 if self.signals.hurry.is_set() else max(0.0, self.deadline - time.monotonic())

    def spin(self) -> None:
        """One slice of the executor (queries arriving meanwhile are answered shutting_down)."""
        if self.executor.context.ok():
            try:
                self.executor.spin_once(timeout_sec=SLICE_S)
            except Exception:  # noqa: BLE001 - a callback's, as spin_once_surviving_callbacks
                self.node.get_logger().error("a callback raised during the drain:\n" + traceback.format_exc())
        else:
            time.sleep(SLICE_S)
        self.signals.log_new(self.node.get_logger())

    def cancel_configure(self) -> None:
        """A configure in progress gives up within CONFIGURE_GIVE_UP_S (less where the deadline is
        nearer), or the stop goes on without it (DriveNode.stop_configure)."""
        if self.node.configure_scope.active:
            self.node.stop_configure(self.signals.first or "lifecycle shutdown",
                                     min(CONFIGURE_GIVE_UP_S, self.left() or CONFIGURE_GIVE_UP_S), between=self.spin)

    def drain_server(self) -> None:
        """The server stops intake and drains (server.shutdown: queued queries answered shutting_down
        at once, the running one waited for until the deadline less ACK_RESERVE_S), while the
        executor spins."""
        server = self.node.server
        budget = max(0.0, self.left() - ACK_RESERVE_S)
        drained = threading.Event()
        threading.Thread(target=lambda: (server.shutdown(budget, give_up=self.signals.hurry), drained.set()),
                         name="litevlm-drain", daemon=True).start()
        while not drained.is_set():
            self.spin()

    def take_held_queries(self) -> int:
        """Every query the query readers already hold, answered shutting_down (a burst published
        just before the signal is in the DDS reader, not yet taken by the executor; destroying the
        node would lose it). The executor has stopped: the readers are taken from directly."""
        taken = 0
        for sub, submit in self.node.query_readers():
            while True:
                with sub.handle:
                    got = sub.handle.take_message(sub.msg_type, sub.raw)
                if got is None:
                    break
                submit(got[0])
                taken += 1
        return taken

    def wait_for_acks(self) -> None:
        """Each answer publisher waits for its subscribers' acknowledgements, in slices, until the
        deadline (at least one slice). Fast DDS readers acknowledge when the writer's heartbeat asks
        (every 3 s by default; the node's profile makes it 50 ms: dds_env.py): what is still
        unacknowledged at the deadline is said, per topic, with its matched subscribers."""
        pending = [p for p in self.node.answer_publishers() if p.get_subscription_count() > 0]
        first = True
        while pending and (first or self.left() > 0):
            first = False
            pending = [p for p in pending if not p.wait_for_all_acked(Duration(nanoseconds=int(SLICE_S * 1e9)))]
            self.signals.log_new(self.node.get_logger())
        for pub in pending:
            self.node.get_logger().warning(
                f"{pub.topic_name}: {pub.get_subscription_count()} subscriber(s) matched, not all of which had "
                f"acknowledged everything published when the drain's deadline came (drain_timeout_s "
                f"{self.node.server.settings.drain_timeout_s:g}); a reader acknowledges when the writer's heartbeat "
                "asks (Fast DDS heartbeat_period: 3 s unless a profile sets it), so they may still have it all")


def drain_and_close(node: DriveNode, executor, signals: Signals | None = None) -> None:
    """Shut down without losing an answer, within the drain's deadline (Drain): a configure in
    progress is cancelled; the server stops intake and drains while the executor keeps spinning (a
    query still arriving is answered shutting_down); the executor stops and the queries the readers
    still hold are answered too; the answer publishers wait for their subscribers'
    acknowledgements; the summary is logged; only then does the context go."""
    signals = signals or Signals()
    drain = Drain(node, executor, signals)
    drain.cancel_configure()
    drain.drain_server()
    configuring = node.configure_scope.active       # (a load stuck in one call: its thread is not waited for)
    executor.remove_node(node)
    executor.shutdown(timeout_sec=0 if configuring else None, wait_for_threads=not configuring)
    if executor.context.ok():
        taken = drain.take_held_queries()
        if taken:
            node.get_logger().info(f"stopping: {taken} queries the readers still held answered shutting_down")
        drain.wait_for_acks()
        if node.finalized.is_set():
            time.sleep(REPLY_GRACE_S)
    node.log_summary()
    node.destroy_node()
    if rclpy.ok():
        rclpy.shutdown()


def drive_lifecycle(node: DriveNode, stop: threading.Event) -> None:
    """configure, then activate when it succeeded (what the launch file requests), off the
    executor's threads: the services answer meanwhile. Nothing once a stop began."""
    if stop.is_set():
        return
    node.trigger_configure()
    if node.state == "inactive" and not stop.is_set():
        node.trigger_activate()
    node.get_logger().info(f"ready ({node.state})")


def spin_once_surviving_callbacks(node: DriveNode, executor) -> None:
    """One spin of the executor. rclpy's MultiThreadedExecutor re-raises a callback's exception
    in spin_once, which would end the node (drain, exit) on the first bug in any timer or
    subscription callback, with every later query unanswered: the exception is logged with its
    traceback and counted on /diagnostics, and the node goes on serving."""
    try:
        executor.spin_once(timeout_sec=SLICE_S)
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
    with an error and reports the cause on /diagnostics. With no Fast DDS profile in the
    environment, the node takes its own (config/fastdds_node.xml: a 50 ms writer heartbeat)."""
    use_node_profile_if_none()
    use_profile_memory_policy()
    limit_malloc_arenas()
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    signals = Signals()
    signals.install()
    stop = signals.stop
    node = DriveNode(node_name)
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    executor.add_node(node)
    try:
        if self_drive:
            threading.Thread(target=drive_lifecycle, args=(node, stop), name="litevlm-lifecycle", daemon=True).start()
        while not stop.is_set() and not node.finalized.is_set() and executor.context.ok():
            spin_once_surviving_callbacks(node, executor)
            node.between_spins()
        why = f"signal {signals.first}" if stop.is_set() else "finalized (lifecycle shutdown)"
        node.get_logger().info(f"stopping: draining the request queue ({why})")
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        drain_and_close(node, executor, signals)
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
