"""The LiteVLM ROS 2 node: a thin lifecycle adapter between DDS and the QueryServer.

  constructed   query subscriptions, answer publishers and /diagnostics exist from the start,
                so a query that arrives before the model is ready still gets an answer
                (status not_active, or pipeline_error naming why the model failed to load)
  configure     loads the model (Pipeline.from_pretrained) and warms it up
  activate      subscribes to the six cameras and starts the pipeline worker thread
  deactivate    unsubscribes the cameras; queued queries are answered not_active
Everything between "a query arrives" and "an answer record" is server.QueryServer, shared
with `litevlm bag eval`; this file only converts messages.

Topic types: a camera topic whose name ends in "/compressed" carries sensor_msgs/CompressedImage
(JPEG or PNG), any other sensor_msgs/Image (rgb8, bgr8, mono8), as image_transport names them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.duration import Duration
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String

from litevlm_msgs.msg import Answer, Query

from ..answer import STAGES
from ..cameras import CAMERAS
from .frame_store import Frame
from .images import payload_from_msg
from .parameters import declare_pipeline_parameters, pipeline_options_from, pipeline_settings
from .server import AnswerRecord, QueryServer, ServerSettings

NODE_NAME = "litevlm_drive"
# Queries and answers must not be lost: reliable, and deep enough for a burst of questions.
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
# The query subscriptions keep all: a keep-last reader overwrites queries the executor has not
# taken yet, which lost 18-55% of a 1,000/s burst at depth 100. With KEEP_ALL the reader's
# history grows instead and reliable flow control holds the writers back when it is full.
QUERY_QOS = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)

DEFAULT_CAMERA_TOPICS = [f"/{c.lower()}/image_raw/compressed" for c in CAMERAS]
# The node's own parameters (name -> default); the pipeline's settings are declared from the typed
# configuration (ros/parameters.py) under their dotted names, e.g. tokens.keep_ratio.
PARAMETERS = {
    "model_dir": "",                  # an InternVL2.5-layout folder ("": the bundled SynthDrive model)
    "warmup": True,
    "camera_topics": DEFAULT_CAMERA_TOPICS,
    "query_topic": "/litevlm/query",
    "question_topic": "/litevlm/question",
    "answer_topic": "/litevlm/answer",
    "answer_json_topic": "/litevlm/answer_json",
    "diagnostics_period_s": 1.0,
    "max_skew_s": 0.1,
    "max_frame_age_s": 1.0,
    "frame_history": 8,
    "queue_size": 4,
    "overflow_policy": "reject_new",
    "max_question_chars": 2000,
    "match_wait_s": 0.2,
}
def config_dir() -> Path:
    """config/ of the installed ROS package if there is one, else of this source tree."""
    try:
        from ament_index_python.packages import get_package_share_directory
        d = Path(get_package_share_directory("litevlm")) / "config"
        if d.is_dir():
            return d
    except Exception:  # noqa: BLE001 - not installed as a ROS package: use the source tree
        pass
    return Path(__file__).resolve().parents[2] / "config"


def use_large_data_profile() -> None:
    """Point Fast DDS at config/fastdds_large_data.xml unless the user chose a profile already.
    Must run before rclpy.init (the DDS participant reads it when created)."""
    if not os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE"):
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(config_dir() / "fastdds_large_data.xml")


def ns_of(t: Time) -> int:
    return int(t.sec) * 1_000_000_000 + int(t.nanosec)


def time_of(ns: int) -> Time:
    return Time(sec=int(ns // 1_000_000_000), nanosec=int(ns % 1_000_000_000))


def record_to_msg(rec: AnswerRecord) -> Answer:
    msg = Answer()
    msg.header.stamp = time_of(rec.query_stamp_ns)     # the query's stamp: receipt - stamp = latency
    msg.query_id, msg.question, msg.answer = rec.query_id, rec.question, rec.answer
    msg.token_ids = [int(t) for t in rec.token_ids]
    msg.status, msg.status_message = rec.status_code, rec.status_message
    msg.cameras = list(rec.cameras)
    msg.stage_names = list(rec.stage_ms)
    msg.stage_ms = [float(v) for v in rec.stage_ms.values()]
    msg.total_ms, msg.queue_ms = float(rec.total_ms), float(rec.queue_ms)
    msg.visual_tokens, msg.kept_tokens = rec.visual_tokens, rec.kept_tokens
    msg.input_tokens, msg.decode_steps = rec.input_tokens, rec.decode_steps
    msg.accepted_length = float(rec.accepted_length)
    msg.pipeline = rec.pipeline
    msg.frame_cameras = list(rec.frame_stamps_ns)
    msg.frame_stamps = [time_of(s) for s in rec.frame_stamps_ns.values()]
    return msg


class DriveNode(LifecycleNode):
    def __init__(self, node_name: str = NODE_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        for name, default in PARAMETERS.items():
            self.declare_parameter(name, default)
        declare_pipeline_parameters(self)
        self.p = self._params()
        if len(self.p["camera_topics"]) != len(CAMERAS):
            raise ValueError(f"camera_topics needs {len(CAMERAS)} topics in rig order {CAMERAS}, "
                             f"got {len(self.p['camera_topics'])}")
        self.server = QueryServer(self._settings(), self._publish, clock_ns=self._now_ns)
        self.answer_pub = self.create_publisher(Answer, self.p["answer_topic"], RELIABLE)
        self.answer_json_pub = self.create_publisher(String, self.p["answer_json_topic"], RELIABLE)
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.create_subscription(Query, self.p["query_topic"], self._on_query, QUERY_QOS)
        self.create_subscription(String, self.p["question_topic"], self._on_question, QUERY_QOS)
        self.create_timer(self.p["diagnostics_period_s"], self._publish_diagnostics)
        self.create_timer(0.01, self.server.retry_pending)     # queries waiting for frames in flight
        self._camera_subs = []
        self._state = "unconfigured"

    def _params(self) -> dict:
        names = list(PARAMETERS) + [s.key for s in pipeline_settings()]
        return {name: self.get_parameter(name).value for name in names}

    def _settings(self) -> ServerSettings:
        p = self.p
        return ServerSettings(cameras=CAMERAS, max_skew_s=p["max_skew_s"], max_frame_age_s=p["max_frame_age_s"],
                              frame_history=p["frame_history"], queue_size=p["queue_size"],
                              overflow_policy=p["overflow_policy"], max_question_chars=p["max_question_chars"],
                              match_wait_s=p["match_wait_s"])

    def _now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    # ---- lifecycle ----
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        self.p = self._params()
        self.server.apply_settings(self._settings())    # parameters may have changed since construction
        from ..bundled import DEFAULT_MODEL

        model_dir = self.p["model_dir"] or str(DEFAULT_MODEL)      # "": the bundled default model
        self.model_name = self.p["model_dir"] or f"{Path(model_dir).name} (bundled)"
        try:
            options = pipeline_options_from(self.p)
            self.get_logger().info(f"configure: loading {model_dir} (pipeline {options.pipeline.value}, backend "
                                   f"{options.backend.name.value}, {options.device}, {options.dtype})")

            def factory():
                from ..pipeline import Pipeline

                return Pipeline.from_pretrained(model_dir, options)
            self.server.load(factory, warmup=self.p["warmup"])
        except Exception as exc:  # noqa: BLE001 - the node stays up and says why in every answer
            self.get_logger().error(f"configure failed: {type(exc).__name__}: {exc}")
            self._state = "failed"
            return TransitionCallbackReturn.FAILURE
        self._state = "inactive"
        self.get_logger().info(f"configure: model loaded and warmed up; serving {self.server.pipeline.options.label()}")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        for cam, topic in zip(CAMERAS, self.p["camera_topics"]):
            msg_type = CompressedImage if topic.rstrip("/").endswith("/compressed") else Image
            cb = (lambda m, c=cam: self._on_image(c, m))
            self._camera_subs.append(self.create_subscription(msg_type, topic, cb, qos_profile_sensor_data))
        self.server.active = True
        self.server.start_worker()
        self._state = "active"
        self.get_logger().info("activate: listening on " + ", ".join(self.p["camera_topics"]))
        return super().on_activate(state)

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        self.server.active = False
        self.server.stop_worker()
        for sub in self._camera_subs:
            self.destroy_subscription(sub)
        self._camera_subs = []
        self._state = "inactive"
        return super().on_deactivate(state)

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        self.server.pipeline = None
        self._state = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        self.server.shutdown()      # queued queries answered shutting_down, the running one finishes
        self._state = "finalized"
        return TransitionCallbackReturn.SUCCESS

    # ---- callbacks (executor thread: cheap work only) ----
    def _on_image(self, camera: str, msg) -> None:
        """A CompressedImage or Image: kept undecoded until a query selects this camera."""
        self._add_frame(camera, ns_of(msg.header.stamp), payload_from_msg(msg))

    def _add_frame(self, camera: str, stamp_ns: int, payload) -> None:
        self.server.frame_delay_ms.append((self._now_ns() - stamp_ns) / 1e6)
        self.server.frames.add(Frame(camera, stamp_ns, payload))

    def log_summary(self) -> None:
        s = self.server.stats()
        d50, d90, n = s["frame_delay_ms"]
        lat = s["latency_ms"].get("total")
        errors = ", ".join(f"{k} {v}" for k, v in s["status_counts"].items() if v and k != "ok")
        lost = f", {s['publish_failed']} not delivered (publish failed)" if s["publish_failed"] else ""
        self.get_logger().info(
            f"summary: {s['answered']} answered ({s['errors']} errors{': ' + errors if errors else ''}){lost}; frames {sum(s['frames_received'].values())} received, stamp->arrival p50 {d50:.2f} ms "
            f"p90 {d90:.2f} ms; pipeline total "
            + (f"p50 {lat[0]:.1f} ms p90 {lat[1]:.1f} ms" if lat else "-"))

    def _on_query(self, msg: Query) -> None:
        self.server.submit(msg.text, query_id=msg.id, stamp_ns=ns_of(msg.header.stamp), deadline_ns=ns_of(msg.deadline))

    def _on_question(self, msg: String) -> None:
        self.server.submit(msg.data)

    # ---- output (worker thread or executor thread) ----
    def _publish(self, rec: AnswerRecord) -> None:
        self.answer_pub.publish(record_to_msg(rec))
        self.answer_json_pub.publish(String(data=json.dumps(rec.to_json())))
        # (rclpy's logger wants one severity per call site, hence two calls.)
        if rec.status == "ok":
            self.get_logger().info(f"{rec.query_id} [ok] {rec.total_ms:.1f} ms: {rec.answer[:80]!r}")
        else:
            self.get_logger().warning(f"{rec.query_id} [{rec.status}] {rec.status_message}")

    def _publish_diagnostics(self) -> None:
        s = self.server.stats()
        status = DiagnosticStatus(name=f"{self.get_name()}: vision-language node", hardware_id=str(self.p["device"]))
        if self.server.load_error:
            status.level, status.message = DiagnosticStatus.ERROR, f"model not loaded: {self.server.load_error}"
        elif self._state != "active":
            status.level, status.message = DiagnosticStatus.WARN, f"lifecycle state {self._state}"
        else:
            status.level, status.message = DiagnosticStatus.OK, f"serving ({s['answered']} answered, {s['errors']} errors)"
        values = {
            "state": self._state,
            "model": getattr(self, "model_name", "") or self.p["model_dir"],
            "pipeline": self.server.pipeline.options.label() if self.server.pipeline else "",
            "backend": self.p["backend.name"],
            "device": self.p["device"],
            "dtype": self.p["dtype"],
            "queue_depth": s["queue_depth"],
            "queue_size": s["queue_size"],
            "waiting_for_frames": s["waiting_for_frames"],
            "overflow_policy": s["overflow_policy"],
            "answered": s["answered"],
            "errors": s["errors"],
            "last_error": s["last_error"],
            "dropped_frames": sum(s["frames_dropped"].values()),
            "bad_stamp_frames": sum(s["frames_bad_stamp"].values()),
            "publish_failed": s["publish_failed"],
            "frame_delay_ms.p50": f"{s['frame_delay_ms'][0]:.2f}",
            "frame_delay_ms.p90": f"{s['frame_delay_ms'][1]:.2f}",
        }
        for st, n in s["status_counts"].items():
            values[f"status.{st}"] = n
        for stage in (*STAGES, "total", "queue"):
            if stage in s["latency_ms"]:
                p50, p90, n = s["latency_ms"][stage]
                values[f"latency_ms.{stage}.p50"] = f"{p50:.2f}"
                values[f"latency_ms.{stage}.p90"] = f"{p90:.2f}"
        for cam in CAMERAS:
            values[f"frames_received.{cam}"] = s["frames_received"][cam]
            values[f"frames_dropped.{cam}"] = s["frames_dropped"][cam]
            values[f"frames_bad_stamp.{cam}"] = s["frames_bad_stamp"][cam]
            values[f"frames_history_resets.{cam}"] = s["frames_history_resets"][cam]
        status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
        arr = DiagnosticArray(status=[status])
        arr.header.stamp = self.get_clock().now().to_msg()
        self.diag_pub.publish(arr)


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
    for pub in (node.answer_pub, node.answer_json_pub):
        if executor.context.ok() and not pub.wait_for_all_acked(Duration(seconds=ack_timeout_s)):
            node.get_logger().warning(f"{pub.topic_name}: not every subscriber acknowledged within {ack_timeout_s:.0f} s")
    node.log_summary()
    node.destroy_node()
    if rclpy.ok():
        rclpy.shutdown()


def run_node(params_file: str | None = None, overrides: dict | None = None, node_name: str = NODE_NAME,
             ros_args: list[str] | None = None, self_drive: bool = True) -> int:
    """Start the node and spin until SIGINT or SIGTERM, then drain (drain_and_close). With
    self_drive (`litevlm drive`) the node takes itself through configure and activate, as a
    lifecycle manager does under `ros2 launch`. A failed configure keeps the node up: it answers
    every query with pipeline_error and reports the cause on /diagnostics."""
    use_large_data_profile()
    args = list(ros_args or [])
    if params_file or overrides:
        args += ["--ros-args"]
    if params_file:
        args += ["--params-file", str(params_file)]
    for k, v in (overrides or {}).items():
        args += ["-p", f"{k}:={v}"]
    # rclpy's own handlers would shut the context down on the signal, before the worker could
    # publish what it owes ("publisher's context is invalid"): the node handles both itself.
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()
        signal.signal(signum, signal.SIG_DFL)      # a second one ends the process at once

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    node = DriveNode(node_name)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        if self_drive:
            node.trigger_configure()
            if node._state == "inactive":
                node.trigger_activate()
            node.get_logger().info(f"ready ({node._state})")
        while not stop.is_set() and executor.context.ok():
            executor.spin_once(timeout_sec=0.1)
        node.get_logger().info("stopping: draining the request queue")
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        drain_and_close(node, executor)
    return 0


def main() -> int:
    """`litevlm_drive_node`: the executable launch_ros starts (lib/litevlm/litevlm_drive_node);
    transitions come from the launch file or `ros2 lifecycle set`."""
    import sys
    return run_node(ros_args=sys.argv, self_drive=False)
