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
from pathlib import Path

import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.executors import ExternalShutdownException
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String

from litevlm_msgs.msg import Answer, Query

from ..answer import STAGES
from ..cameras import CAMERAS
from .frame_store import Frame
from .images import CompressedPayload, RawPayload
from .server import AnswerRecord, QueryServer, ServerSettings

NODE_NAME = "litevlm_drive"
# Queries and answers must not be lost: reliable, and deep enough for a burst of questions.
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)

DEFAULT_CAMERA_TOPICS = [f"/{c.lower()}/image_raw/compressed" for c in CAMERAS]
# name -> default; the same names and meanings as config/drive.yaml.
PARAMETERS = {
    "model_dir": "",
    "backend": "torch",               # stage engines: torch (CPU or CUDA); more backends plug in here
    "device": "cpu",
    "precision": "float32",           # float32 | float16 | bfloat16
    "tiles_per_camera": 1,
    "max_new_tokens": 64,
    "max_question_tokens": 256,
    "threads": 0,                     # torch intra-op threads (0: torch's default)
    "view_selection": "all",          # all | selector (text-only view selector before any image decode)
    "view_select_threshold": 0.4,     # view selector: keep a camera whose fused score reaches this
    "view_selector": "",              # view selector folder ("": the model folder's, if any)
    "token_keep_ratio": 1.0,          # token selector: fraction of visual tokens kept (1.0: selector off)
    "token_selector": "",             # token selector folder ("": the model folder's, if any)
    "eagle_enabled": False,           # EAGLE-2 speculative decoding (lossless under greedy)
    "eagle_dir": "",                  # draft head folder ("": <model_dir>/eagle)
    "eagle_total_tokens": 60,
    "eagle_depth": 6,
    "eagle_top_k": 10,
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
PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


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


# Node parameter -> (PipelineOptions field, conversion). A field the pipeline in this checkout
# does not have yet travels in PipelineOptions.extra under the parameter's name.
OPTION_MAP = {
    "backend": ("backend", str),
    "device": ("device", str),
    "precision": ("dtype", lambda v: PRECISIONS.get(v, v)),
    "tiles_per_camera": ("tiles_per_camera", int),
    "max_new_tokens": ("max_new_tokens", int),
    "max_question_tokens": ("max_question_tokens", int),
    "threads": ("threads", lambda v: int(v) or None),
    "view_selection": ("view_selection", str),
    "view_select_threshold": ("view_threshold", float),
    "view_selector": ("view_selector_dir", lambda v: v or None),
    "token_keep_ratio": ("token_keep_ratio", float),
    "token_selector": ("token_selector", lambda v: v or None),
    "eagle_enabled": ("decoding", lambda v: "eagle" if v else "greedy"),
    "eagle_dir": ("eagle_dir", lambda v: v or None),
    "eagle_total_tokens": ("eagle_total", int),
    "eagle_depth": ("eagle_depth", int),
    "eagle_top_k": ("eagle_topk", int),
}


def pipeline_options(p: dict):
    """Node parameters -> PipelineOptions (see OPTION_MAP)."""
    from dataclasses import fields

    from ..pipeline import PipelineOptions

    known = {f.name for f in fields(PipelineOptions)}
    values, extra = {}, {}
    for param, (option, convert) in OPTION_MAP.items():
        if param not in p:
            continue
        if option in known:
            values[option] = convert(p[param])
        else:
            extra[param] = p[param]
    if "extra" in known:
        values["extra"] = extra
    return PipelineOptions(**values)


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
    msg.frame_cameras = list(rec.frame_stamps_ns)
    msg.frame_stamps = [time_of(s) for s in rec.frame_stamps_ns.values()]
    return msg


class DriveNode(LifecycleNode):
    def __init__(self, node_name: str = NODE_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        for name, default in PARAMETERS.items():
            self.declare_parameter(name, default)
        self.p = self._params()
        if len(self.p["camera_topics"]) != len(CAMERAS):
            raise ValueError(f"camera_topics needs {len(CAMERAS)} topics in rig order {CAMERAS}, "
                             f"got {len(self.p['camera_topics'])}")
        self.server = QueryServer(self._settings(), self._publish, clock_ns=self._now_ns)
        self.answer_pub = self.create_publisher(Answer, self.p["answer_topic"], RELIABLE)
        self.answer_json_pub = self.create_publisher(String, self.p["answer_json_topic"], RELIABLE)
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.create_subscription(Query, self.p["query_topic"], self._on_query, RELIABLE)
        self.create_subscription(String, self.p["question_topic"], self._on_question, RELIABLE)
        self.create_timer(self.p["diagnostics_period_s"], self._publish_diagnostics)
        self.create_timer(0.01, self.server.retry_pending)     # queries waiting for frames in flight
        self._camera_subs = []
        self._state = "unconfigured"

    def _params(self) -> dict:
        return {name: self.get_parameter(name).value for name in PARAMETERS}

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
        model_dir = self.p["model_dir"]
        self.get_logger().info(f"configure: loading {model_dir or '(the bundled default model)'} "
                               f"({self.p['backend']}, {self.p['device']}, {self.p['precision']})")
        try:
            def factory():
                from ..pipeline import Pipeline
                from ..bundled import DEFAULT_MODEL

                # "": the bundled default model
                return Pipeline.from_pretrained(model_dir or DEFAULT_MODEL, pipeline_options(self.p))
            self.server.load(factory, warmup=self.p["warmup"])
        except Exception as exc:  # noqa: BLE001 - the node stays up and says why in every answer
            self.get_logger().error(f"configure failed: {type(exc).__name__}: {exc}")
            self._state = "failed"
            return TransitionCallbackReturn.FAILURE
        self._state = "inactive"
        self.get_logger().info("configure: model loaded and warmed up")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        for cam, topic in zip(CAMERAS, self.p["camera_topics"]):
            msg_type = CompressedImage if topic.rstrip("/").endswith("/compressed") else Image
            cb = (lambda m, c=cam: self._on_compressed(c, m)) if msg_type is CompressedImage \
                else (lambda m, c=cam: self._on_raw(c, m))
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
        self.server.active = False
        self.server.stop_worker("node shutting down")
        self._state = "finalized"
        return TransitionCallbackReturn.SUCCESS

    # ---- callbacks (executor thread: cheap work only) ----
    def _on_compressed(self, camera: str, msg: CompressedImage) -> None:
        self._add_frame(camera, ns_of(msg.header.stamp), CompressedPayload(msg.format, bytes(msg.data)))

    def _on_raw(self, camera: str, msg: Image) -> None:
        self._add_frame(camera, ns_of(msg.header.stamp), RawPayload(msg.encoding, msg.height, msg.width, msg.step,
                                                                    bytes(msg.data)))

    def _add_frame(self, camera: str, stamp_ns: int, payload) -> None:
        self.server.frame_delay_ms.append((self._now_ns() - stamp_ns) / 1e6)
        self.server.frames.add(Frame(camera, stamp_ns, payload))

    def log_summary(self) -> None:
        s = self.server.stats()
        d50, d90, n = s["frame_delay_ms"]
        lat = s["latency_ms"].get("total")
        errors = ", ".join(f"{k} {v}" for k, v in s["status_counts"].items() if v and k != "ok")
        self.get_logger().info(
            f"summary: {s['answered']} answered ({s['errors']} errors{': ' + errors if errors else ''}); frames {sum(s['frames_received'].values())} received, stamp->arrival p50 {d50:.2f} ms "
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
        status = DiagnosticStatus(name=f"{self.get_name()}: vision-language node", hardware_id=self.p["device"])
        if self.server.load_error:
            status.level, status.message = DiagnosticStatus.ERROR, f"model not loaded: {self.server.load_error}"
        elif self._state != "active":
            status.level, status.message = DiagnosticStatus.WARN, f"lifecycle state {self._state}"
        else:
            status.level, status.message = DiagnosticStatus.OK, f"serving ({s['answered']} answered, {s['errors']} errors)"
        values = {
            "state": self._state,
            "model": self.p["model_dir"],
            "backend": self.p["backend"],
            "precision": self.p["precision"],
            "queue_depth": s["queue_depth"],
            "queue_size": s["queue_size"],
            "waiting_for_frames": s["waiting_for_frames"],
            "overflow_policy": s["overflow_policy"],
            "answered": s["answered"],
            "errors": s["errors"],
            "last_error": s["last_error"],
            "dropped_frames": sum(s["frames_dropped"].values()),
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
        status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
        arr = DiagnosticArray(status=[status])
        arr.header.stamp = self.get_clock().now().to_msg()
        self.diag_pub.publish(arr)


def run_node(params_file: str | None = None, overrides: dict | None = None, node_name: str = NODE_NAME,
             ros_args: list[str] | None = None, self_drive: bool = True) -> int:
    """Start the node and spin until Ctrl-C. With self_drive (`litevlm drive`) the node takes
    itself through configure and activate, as a lifecycle manager does under `ros2 launch`. A
    failed configure keeps the node up: it answers every query with pipeline_error and reports
    the cause on /diagnostics."""
    use_large_data_profile()
    args = list(ros_args or [])
    if params_file or overrides:
        args += ["--ros-args"]
    if params_file:
        args += ["--params-file", str(params_file)]
    for k, v in (overrides or {}).items():
        args += ["-p", f"{k}:={v}"]
    rclpy.init(args=args)
    node = DriveNode(node_name)
    try:
        if self_drive:
            node.trigger_configure()
            if node._state == "inactive":
                node.trigger_activate()
            node.get_logger().info(f"ready ({node._state})")
        rclpy.spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.server.active = False
        node.server.stop_worker("node shutting down")
        node.log_summary()
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0


def main() -> int:
    """`litevlm_drive_node`: the executable launch_ros starts (lib/litevlm/litevlm_drive_node);
    transitions come from the launch file or `ros2 lifecycle set`."""
    import sys
    return run_node(ros_args=sys.argv, self_drive=False)
