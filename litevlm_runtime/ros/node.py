"""The LiteVLM ROS 2 node: a thin lifecycle adapter between DDS and the QueryServer.

  constructed   parameters declared (parameters.py); query subscriptions, answer publishers and
                /diagnostics exist from the start, so a query that arrives before the model is
                ready still gets an answer (not_active, or pipeline_error naming why)
  configure     validates every parameter (a bad one fails the transition, named in the log and
                on /diagnostics; the process stays up), loads the model and warms it up
  activate      subscribes to the six cameras and starts the pipeline worker thread
  deactivate    unsubscribes the cameras; queued queries are answered not_active
  shutdown      drains the server; the process then ends (runner.py)
Everything between "a query arrives" and "an answer record" is serving.QueryServer, shared with
`litevlm bag eval`; here messages become requests (convert.py) and records messages
(messages.py), parameters become settings, and the lifecycle state is rclpy's own state machine.
/diagnostics is diagnostics.py, the process runner.py.

Topic names are relative (topics.py); the shipped names come from remapping. The cameras' readers
(raw or compressed, renewed when a publisher leaves) are camera_readers.py.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import State as StateMsg
from lifecycle_msgs.msg import Transition, TransitionDescription
from litevlm_msgs.msg import Answer, AnswerPartial, Query
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.lifecycle import State, TransitionCallbackReturn
from rclpy.lifecycle.node import LifecycleNodeMixin
from rclpy.node import Node
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage
from std_msgs.msg import String

from ..bundled import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from ..cameras import CAMERAS
from ..errors import CheckpointError, InputError
from ..pipeline.pipeline import Pipeline
from ..serving.cancel import Cancelled, CancelScope
from ..serving.explainer import Explained, Explainer
from ..serving.record import AnswerRecord, PartialRecord
from ..serving.server import QueryServer
from ..serving.settings import standing_questions
from ..weights.integrity import integrity_label, require_manifest_error
from .camera_readers import CameraReaders
from .convert import request_from_query, request_from_question
from .diagnostics import CameraMonitor, diagnostic_array
from .memory import release_memory, rss_mb
from .messages import partial_to_msg, record_to_msg, time_of
from .parameters import (
    NODE_NAME,
    PARAMETERS,
    NodeSettings,
    all_settings,
    check_live_change,
    declare_parameters,
    validate_values,
)
from .topics import ANSWER, ANSWER_JSON, ANSWER_PARTIAL, DIAGNOSTICS, EXPLANATION, QUERY, QUESTION, standing_topic

# Queries and answers must not be lost: reliable, and deep enough for a burst of questions.
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
# The query subscriptions keep all: a keep-last reader overwrites queries the executor has not
# taken yet, which lost 18-55% of a 1,000/s burst at depth 100. With KEEP_ALL the reader's
# history grows instead and reliable flow control holds the writers back when it is full.
QUERY_QOS = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)
# Explanation pictures (a few hundred kB each): reliable, as the answers they belong to; a subscriber
# that falls behind by more than this many loses the oldest (the answers themselves are unaffected).
EXPLANATION_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
# Queries taken from a reader in one callback, at most (DriveNode._on_queries).
QUERY_BATCH = 64
# How long a stop during configure (a lifecycle shutdown here, SIGINT in runner.py) waits for the load
# to give up (serving/cancel.py) before it goes on without it: inside launch's 5 s SIGTERM timeout,
# and within the 3 s a stop may take (docs/ros.md).
CONFIGURE_GIVE_UP_S = 1.0


def model_label(model_dir: str) -> str:
    """What /diagnostics calls the model: the folder as given, or the bundled one's name."""
    return model_dir or f"{DEFAULT_MODEL_NAME} (bundled)"


class DriveNode(LifecycleNodeMixin, Node):
    def __init__(self, node_name: str = NODE_NAME, **kwargs):
        Node.__init__(self, node_name, **kwargs)
        # The lifecycle services in a reentrant group of their own: `get_state` answers (and says
        # "configuring") while a transition's callback runs on another executor thread.
        LifecycleNodeMixin.__init__(self, callback_group=ReentrantCallbackGroup())
        self.refused = declare_parameters(self)           # start values refused (or unknown): configure fails on them
        self.config_error = ""
        self.callback_errors, self.last_callback_error = 0, ""   # callbacks that raised (runner.py)
        self.settings = NodeSettings()                      # configure replaces it by the validated values
        self.model_name = model_label(str(self.get_parameter("model_dir").value))
        # ~/explanation: each explained answer's picture, computed after the answer is out (serving/explainer.py);
        # with the default `explain: subscribed`, only while this publisher has a subscriber.
        self.explanation_pub = self.create_publisher(CompressedImage, EXPLANATION, EXPLANATION_QOS)
        self.server = QueryServer(self.settings.server_settings(CAMERAS), self._publish, clock_ns=self.now_ns,
                                  publish_partial=self._publish_partial, explainer=Explainer(self._publish_explanation),
                                  explanation_subscribed=lambda: self.explanation_pub.get_subscription_count() > 0,
                                  publish_standing=self._publish_standing)
        self.standing_pubs: dict = {}        # standing question name -> its ~/standing/NAME publisher (configure)
        self.cameras = CameraMonitor()
        self.answer_pub = self.create_publisher(Answer, ANSWER, RELIABLE)
        self.answer_json_pub = self.create_publisher(String, ANSWER_JSON, RELIABLE)
        self.partial_pub = self.create_publisher(AnswerPartial, ANSWER_PARTIAL, RELIABLE)
        self.diag_pub = self.create_publisher(DiagnosticArray, DIAGNOSTICS, 10)
        query_sub = self.create_subscription(Query, QUERY, lambda m: self._on_queries(query_sub, m, request_from_query),
                                             QUERY_QOS)
        question_sub = self.create_subscription(
            String, QUESTION, lambda m: self._on_queries(question_sub, m, request_from_question), QUERY_QOS)
        self._query_subs = [(query_sub, lambda m: self.server.submit(request_from_query(m))),
                            (question_sub, lambda m: self.server.submit(request_from_question(m)))]
        self._diag_timer = self.create_timer(float(self.get_parameter("diagnostics_period_s").value),
                                             self.publish_diagnostics)
        self.create_timer(0.01, self._every_10ms)
        self.add_on_set_parameters_callback(self._check_parameters)
        self.add_post_set_parameters_callback(self._apply_parameters)
        self.readers = CameraReaders(self, self.server, self.cameras)   # subscribed at activate
        self.readers.max_pixels = int(self.get_parameter("images.max_pixels").value)   # configure: the validated one
        self.integrity = "not loaded"        # integrity_label of the loaded model folder
        self.finalized = threading.Event()   # set by a lifecycle shutdown: the process ends (runner.py)
        # configure's model load, cancelled by a stop (SIGINT/SIGTERM, runner.py) or a lifecycle
        # shutdown requested while it runs (serving/cancel.py)
        self.configure_scope = CancelScope()
        # Every counter of the summary and /diagnostics runs since the node started (the frame store is
        # rebuilt at configure and carries its counters over: serving/frame_store.py carry_counters).
        self.started_at = time.monotonic()
        self.configures = 0                  # configures that loaded a model
        self._shutdown_while_configuring()

    @property
    def state(self) -> str:
        """The lifecycle state, as rclpy's state machine has it (unconfigured, configuring, inactive ...)."""
        return self._state_machine.current_state[1]

    def destroy_node(self) -> None:
        super().destroy_node()
        # rclpy's LifecycleNode leaves its lifecycle state machine alive, and the state machine
        # holds the rcl node and so the DDS participant: the participant's shared-memory segments
        # (the transport's 32 MB segment, every writer's data-sharing pool) then outlive the
        # process in /dev/shm, 35 MB per run of the node until the machine reboots (measured;
        # tests/ros/test_ros_shutdown.py checks that a stopped node leaves none).
        self._state_machine.destroy_when_not_in_use()

    def _every_10ms(self) -> None:
        if self.server.waiting_for_frames():
            self.readers.take_held()         # frames already here, queued behind other callbacks
        self.server.retry_pending()          # queries waiting for frames in flight
        self.server.expire_deadlines()       # queued queries answered deadline_passed on time

    def between_spins(self) -> None:
        """Work the spinning thread does between executor rounds (runner.py): renewing camera
        readers. Destroying a subscription while another executor thread builds its wait set
        raised InvalidHandle from the subscription's event handler and ended the process (seen
        under load with the multi-threaded executor); between rounds no wait set is being built."""
        if self.readers.to_renew:
            self.readers.renew(self.state == "active")

    def now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    def answer_publishers(self) -> tuple:
        return self.answer_pub, self.answer_json_pub, self.partial_pub, self.explanation_pub

    def _on_queries(self, sub, msg, to_request) -> None:
        """A query, then up to QUERY_BATCH more that its reader already holds, taken here directly:
        each is matched to the frames of its stamp as soon as it is taken (frame_store.py), and
        rclpy's executor takes one message per round of its wait set (a few hundred a second on a
        loaded 2-core machine), so a 1,000/s flood reached matching seconds after its stamps, some
        past frame_window_s (too_old). Bounded, so that camera frames and timers still run between."""
        self.server.submit(to_request(msg))
        for _ in range(QUERY_BATCH):
            with sub.handle:
                got = sub.handle.take_message(sub.msg_type, sub.raw)
            if got is None:
                return
            self.server.submit(to_request(got[0]))

    def query_readers(self) -> list:
        """(subscription, its callback) of the query and question topics (the drain takes what
        they still hold: runner.py)."""
        return list(self._query_subs)

    # ---- parameters (`ros2 param set`) ----
    def _check_parameters(self, params) -> SetParametersResult:
        configured = self.state not in ("unconfigured", "configuring")
        for p in params:
            why = check_live_change(p.name, p.value, configured)
            if why:
                return SetParametersResult(successful=False, reason=why)
        return SetParametersResult(successful=True)

    def _apply_parameters(self, params) -> None:
        ours = all_settings()
        for p in params:
            self.refused.pop(p.name, None)      # a new value replaces a refused start value
        at_configure = [p.name for p in params if p.name in ours and not ours[p.name].live]
        if at_configure:                        # only while unconfigured (_check_parameters)
            if "model_dir" in at_configure:
                self.model_name = model_label(str(self.get_parameter("model_dir").value))
            self.get_logger().info("parameters set, applied at the next configure: " + ", ".join(at_configure))
        live = {p.name: (tuple(p.value) if isinstance(p.value, list) else p.value)
                for p in params if p.name in PARAMETERS and ours[p.name].live}
        if live:
            self.settings = replace(self.settings, **live)
            self.server.apply_live(self.settings.server_settings(CAMERAS))
            self.get_logger().info("parameters applied live: " + ", ".join(f"{k}={v!r}" for k, v in live.items()))

    # ---- lifecycle ----
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        try:
            if self.refused:
                raise InputError("; ".join(self.refused.values()))
            settings, options = validate_values({name: self.get_parameter(name).value for name in all_settings()})
        except InputError as exc:
            return self._configure_failed(f"bad parameter: {exc}")
        self.settings = settings
        self.readers.max_pixels = options.images.max_pixels
        self.server.apply_settings(settings.server_settings(CAMERAS))   # nothing is queued before activate
        self._standing_publishers(settings)
        if self._diag_timer.timer_period_ns != int(settings.diagnostics_period_s * 1e9):
            self.destroy_timer(self._diag_timer)
            self._diag_timer = self.create_timer(settings.diagnostics_period_s, self.publish_diagnostics)
        model_dir = settings.model_dir or str(DEFAULT_MODEL)      # "": the bundled default model
        self.model_name = model_label(settings.model_dir)
        self.get_logger().info(f"configure: loading {model_dir} (pipeline {options.pipeline.value}, backend "
                               f"{options.backend.name.value}, weights {options.backend.weights}, {options.device}, "
                               f"{options.dtype})")

        def factory():
            refused = require_manifest_error(model_dir) if settings.require_manifest else None
            if refused:
                raise CheckpointError(refused)
            return Pipeline.from_pretrained(model_dir, options)
        try:
            # on a thread of its own, which a stop interrupts (serving/cancel.py); this one waits
            self.configure_scope.run(lambda: self.server.load(factory, warmup=settings.warmup),
                                     name="litevlm-configure")
        except Cancelled as exc:
            return self._configure_cancelled(str(exc))
        except Exception as exc:  # noqa: BLE001 - the node stays up and says why in every answer
            return self._configure_failed(f"{type(exc).__name__}: {exc}")
        self.integrity = self.server.integrity = integrity_label(model_dir)
        self.config_error = ""
        self.configures += 1
        self.get_logger().info(
            f"configure: model loaded and warmed up; serving {self.server.pipeline.options.label()}; "
            f"integrity: {self.integrity}"
        )
        if self.integrity.startswith("unverified"):
            self.get_logger().warning(
                f"configure: serving UNVERIFIED weights ({self.integrity}; require_manifest is off): nothing checks "
                f"that they are the files meant (a bit flip in finite weights serves garbage); every answer says "
                f"so (model_integrity); write a manifest once they are checked: litevlm checksum {model_dir}")
        return TransitionCallbackReturn.SUCCESS

    def _configure_failed(self, why: str) -> TransitionCallbackReturn:
        self.config_error = why
        self.get_logger().error(f"configure failed: {why}")
        self.publish_diagnostics()
        return TransitionCallbackReturn.FAILURE

    def _configure_cancelled(self, why: str) -> TransitionCallbackReturn:
        """A stop or a lifecycle shutdown came while configure loaded the model: what was loaded
        is dropped and its memory given back; the node is unconfigured (its answers say so)."""
        seconds = time.monotonic() - self.configure_scope.started
        self.server.pipeline = None
        self.config_error = f"configure cancelled ({why})"
        if self.configure_scope.abandoned:
            # its thread still holds what it built, and the process is ending: a collection and a
            # trim would free nothing and cost the stop's budget (0.6 s at 18 GB)
            freed = f"{rss_mb():.0f} MB, held by the abandoned load until the process ends"
        else:
            freed = release_memory()
        self.get_logger().warning(f"configure cancelled ({why}) after {seconds:.1f} s of loading; the model is "
                                  f"not loaded (RSS {freed})")
        return TransitionCallbackReturn.FAILURE

    def stop_configure(self, why: str, timeout_s: float, between=None) -> None:
        """A stop during configure (`why`: the signal, or "lifecycle shutdown"): the load gives up
        (serving/cancel.py) within `timeout_s` (`between()`: called while waiting); if it is inside one
        long call that long (a shard's read, a finite check of GBs), configure returns without it and
        the stop goes on: the process ends, and the load with it."""
        self.get_logger().warning(f"configure cancelled ({why} during configure): the model load stops")
        if not self.configure_scope.cancel_and_wait(why, timeout_s, between=between):
            self.get_logger().warning(f"configure cancelled: the load is still inside one call after {timeout_s:.1f} "
                                      f"s; going on without waiting for it (the process ends)")
            self.configure_scope.abandon()

    # ---- lifecycle shutdown while configure runs ----
    def _shutdown_while_configuring(self) -> None:
        """`ros2 lifecycle set NODE shutdown` during configure. rcl's state machine has no
        shutdown out of the transition state `configuring` (its transitions there are configure's
        outcomes only), so the CLI, which asks for the available transitions first, would refuse
        with "Unknown transition requested". While configure runs, the node offers `shutdown`
        besides them and, asked for it, cancels configure (the load stops within a call: serving/
        cancel.py), then shuts down from unconfigured as usual: the process ends."""
        transitions_srv, change_srv = self._service_get_available_transitions, self._service_change_state
        rcl_transitions, rcl_change = transitions_srv.callback, change_srv.callback

        def available(req, resp):
            resp = rcl_transitions(req, resp)
            if self.state == "configuring":
                resp.available_transitions.append(TransitionDescription(
                    transition=Transition(id=Transition.TRANSITION_UNCONFIGURED_SHUTDOWN, label="shutdown"),
                    start_state=StateMsg(id=StateMsg.TRANSITION_STATE_CONFIGURING, label="configuring"),
                    goal_state=StateMsg(id=StateMsg.TRANSITION_STATE_SHUTTINGDOWN, label="shuttingdown")))
            return resp

        shutdowns = {Transition.TRANSITION_UNCONFIGURED_SHUTDOWN, Transition.TRANSITION_INACTIVE_SHUTDOWN,
                     Transition.TRANSITION_ACTIVE_SHUTDOWN}

        def change(req, resp):
            wants_shutdown = req.transition.label == "shutdown" or (not req.transition.label
                                                                     and req.transition.id in shutdowns)
            if not (wants_shutdown and self.state == "configuring"):
                return rcl_change(req, resp)
            self.stop_configure("lifecycle shutdown", CONFIGURE_GIVE_UP_S)
            end = time.monotonic() + 10.0
            while self.state == "configuring" and time.monotonic() < end:   # rcl's transition out of it
                time.sleep(0.01)
            resp.success = self.state != "configuring" and self.trigger_shutdown() == TransitionCallbackReturn.SUCCESS
            return resp

        transitions_srv.callback, change_srv.callback = available, change

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        listening = self.readers.subscribe(self.settings.camera_topics)
        self.server.active = True
        self.server.start_worker()
        self.get_logger().info("activate: listening on " + ", ".join(listening))
        return super().on_activate(state)

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        self.server.active = False
        self.server.stop_worker()
        self.readers.unsubscribe()
        return super().on_deactivate(state)

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        """Drop the model, its arena and caches, and give their memory back (release_memory)."""
        self.server.pipeline = None
        self.integrity, self.server.integrity = "not loaded", ""
        freed = release_memory()
        self.get_logger().info(f"cleanup: model released (RSS {freed})")
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        self.server.shutdown()      # queued queries answered shutting_down, the running one finishes
        self.get_logger().info("shutdown: finalized; the process ends")
        self.finalized.set()
        return TransitionCallbackReturn.SUCCESS

    # ---- output (worker thread or executor thread) ----
    def _publish_partial(self, partial: PartialRecord) -> None:
        self.partial_pub.publish(partial_to_msg(partial, self.get_clock().now().to_msg()))

    def _publish(self, rec: AnswerRecord) -> None:
        self.answer_pub.publish(record_to_msg(rec))
        self.answer_json_pub.publish(String(data=json.dumps(rec.to_json())))
        # (rclpy's logger wants one severity per call site, hence two calls.)
        if rec.status == "ok":
            self.get_logger().info(f"{rec.query_id} [ok] {rec.total_ms:.1f} ms: {rec.text[:80]!r}")
        else:
            self.get_logger().warning(f"{rec.query_id} [{rec.status}] {rec.status_message}")

    def _standing_publishers(self, settings: NodeSettings) -> None:
        """One litevlm_msgs/Answer publisher per standing question, ~/standing/NAME (those of
        questions no longer configured are destroyed)."""
        names = set(standing_questions(settings.standing_questions))
        for name in set(self.standing_pubs) - names:
            self.destroy_publisher(self.standing_pubs.pop(name))
        for name in sorted(names - set(self.standing_pubs)):
            self.standing_pubs[name] = self.create_publisher(Answer, standing_topic(name), RELIABLE)

    def _publish_standing(self, name: str, rec: AnswerRecord) -> None:
        """A standing question's answer (worker thread), stamped with the frames it used: header.stamp
        is the newest frame's stamp of the set it was asked on, frame_stamps each camera's."""
        pub = self.standing_pubs.get(name)
        if pub is not None:
            pub.publish(record_to_msg(rec))
        if rec.status == "ok":
            self.get_logger().debug(f"standing {rec.query_id}: {rec.text[:80]!r}")
        else:
            self.get_logger().warning(f"standing {rec.query_id} [{rec.status}] {rec.status_message}")

    def _publish_explanation(self, done: Explained) -> None:
        """An explained answer's picture on ~/explanation (explainer thread), tied to its Answer: the
        same header.stamp (the query's stamp) and header.frame_id = its query_id (docs/ros.md)."""
        msg = CompressedImage(format="jpeg", data=done.picture)
        msg.header.stamp = time_of(done.record.query_stamp_ns)
        msg.header.frame_id = done.record.query_id
        self.explanation_pub.publish(msg)

    def publish_diagnostics(self) -> None:
        self.diag_pub.publish(diagnostic_array(self))

    def counted_since(self) -> str:
        """What every counter of the summary and /diagnostics counts from."""
        return (f"since the node started {time.monotonic() - self.started_at:.0f} s ago "
                f"({self.configures} configure{'s' if self.configures != 1 else ''})")

    def log_summary(self) -> None:
        s = self.server.stats()
        d50, d90, n = s["frame_delay_ms"]
        lat = s["latency_ms"].get("total")
        errors = ", ".join(f"{k} {v}" for k, v in s["status_counts"].items() if v and k != "ok")
        lost = f", {s['publish_failed']} not delivered (publish failed)" if s["publish_failed"] else ""
        self.get_logger().info(
            f"summary: {s['answered']} answered ({s['errors']} errors{': ' + errors if errors else ''}){lost}; "
            f"frames {sum(s['frames_received'].values())} received, stamp->arrival p50 {d50:.2f} ms p90 {d90:.2f} ms; "
            "pipeline total " + (f"p50 {lat[0]:.1f} ms p90 {lat[1]:.1f} ms" if lat else "-") + f"; all counted "
            f"{self.counted_since()}")
        for name, q in s["standing"].items():
            self.get_logger().info(
                f"summary: standing {name}: {q['answered']} answered, {q['unchanged']} unchanged sets, "
                f"{q['preempted']} preempted by asked queries, {q['replaced']} replaced by a newer set, "
                f"{q['unmatched']} unmatched, {q['errors']} errors")
