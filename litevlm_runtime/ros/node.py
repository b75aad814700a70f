"""The LiteVLM ROS 2 node: a thin lifecycle adapter between DDS and the QueryServer.

  constructed   parameters declared (ros/parameters.py); query subscriptions, answer publishers
                and /diagnostics exist from the start, so a query that arrives before the model
                is ready still gets an answer (not_active, or pipeline_error naming why)
  configure     validates every parameter (a bad one fails the transition, named in the log and
                on /diagnostics; the process stays up), loads the model and warms it up
  activate      subscribes to the six cameras and starts the pipeline worker thread
  deactivate    unsubscribes the cameras; queued queries are answered not_active
Everything between "a query arrives" and "an answer record" is server.QueryServer, shared
with `litevlm bag eval`; this file only converts messages and parameters.

Topic names are relative (ros/topics.py); the shipped names come from remapping. A camera topic
whose resolved name (after namespace and remaps) ends in "/compressed" carries
sensor_msgs/CompressedImage, any other sensor_msgs/Image, as image_transport names them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from litevlm_msgs.msg import Answer, AnswerPartial, Query
from rcl_interfaces.msg import SetParametersResult
from rclpy.duration import Duration
from rclpy.event_handler import SubscriptionEventCallbacks
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rclpy.signals import SignalHandlerOptions
from std_msgs.msg import String

from ..bundled import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from ..cameras import CAMERAS
from ..errors import CheckpointError, InputError
from ..pipeline.answer import STAGES
from ..pipeline.pipeline import Pipeline
from ..serving.frame_health import header_defect, too_large
from ..serving.frame_store import Frame
from ..serving.images import payload_from_msg
from ..serving.server import AnswerRecord, PartialRecord, QueryServer
from ..serving.settings import ServerSettings
from ..weights.integrity import integrity_label, require_manifest_error
from .bag_types import message_type_of
from .memory import release_memory
from .parameters import (
    NodeSettings,
    all_settings,
    check_live_change,
    declare_parameters,
    node_settings,
    ros_default,
    validate_values,
)
from .topics import ANSWER, ANSWER_JSON, ANSWER_PARTIAL, DIAGNOSTICS, QUERY, QUESTION, SHIPPED_REMAPS

NODE_NAME = "litevlm_drive"
# Queries and answers must not be lost: reliable, and deep enough for a burst of questions.
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
# The query subscriptions keep all: a keep-last reader overwrites queries the executor has not
# taken yet, which lost 18-55% of a 1,000/s burst at depth 100. With KEEP_ALL the reader's
# history grows instead and reliable flow control holds the writers back when it is full.
QUERY_QOS = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)
# The node's own parameters (name -> default, as ROS values); the pipeline's are options.py's.
PARAMETERS = {s.key: ros_default(s) for s in node_settings()}


def config_dir() -> Path:
    """config/ of the ROS package on the ament index; else of this source tree; else the
    share/litevlm/config that a wheel or `pip install .` put beside this install's lib/
    (<prefix>/lib/python3.X/site-packages/litevlm_runtime/ros/node.py), with no index set up."""
    try:
        from ament_index_python.packages import get_package_share_directory
        d = Path(get_package_share_directory("litevlm")) / "config"
        if d.is_dir():
            return d
    except Exception:  # noqa: BLE001 - not on the ament index: look beside this file
        pass
    here = Path(__file__).resolve()
    source = here.parents[2] / "config"
    installed = here.parents[5] / "share" / "litevlm" / "config" if len(here.parents) > 5 else source
    return source if source.is_dir() or not installed.is_dir() else installed


def large_data_profile() -> Path:
    return config_dir() / "fastdds_large_data.xml"


def use_large_data_profile() -> None:
    """Point Fast DDS at config/fastdds_large_data.xml unless the user chose a profile already
    (the development tools: `litevlm drive`, `litevlm bag replay|record`; never the node
    executable that launch starts). Must run before rclpy.init."""
    if not os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE"):
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(large_data_profile())
    use_profile_memory_policy()


def use_profile_memory_policy() -> None:
    """With the shipped profile in effect, let rmw_fastrtps take its reader memory policy from it
    (RMW_FASTRTPS_USE_QOS_FROM_XML; the XML says why), unless the user set that variable."""
    chosen = os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE", "")
    if chosen and Path(chosen).resolve() == large_data_profile().resolve():
        os.environ.setdefault("RMW_FASTRTPS_USE_QOS_FROM_XML", "1")


def model_label(model_dir: str) -> str:
    """What /diagnostics calls the model: the folder as given, or the bundled one's name."""
    if model_dir:
        return model_dir
    return f"{DEFAULT_MODEL_NAME} (bundled)"


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
    msg.reused_cameras, msg.degraded = list(rec.reused_cameras), list(rec.degraded)
    msg.budget_ms, msg.budget_met = float(rec.budget_ms), bool(rec.budget_met)
    msg.frame_cameras = list(rec.frame_stamps_ns)
    msg.frame_stamps = [time_of(s) for s in rec.frame_stamps_ns.values()]
    msg.follow_up_of, msg.turn, msg.reused_tokens = rec.follow_up_of, rec.turn, rec.reused_tokens
    msg.prompt_sha256 = rec.prompt_sha256
    return msg


def apply_live(server: QueryServer, settings: ServerSettings) -> None:
    """Live limits into a serving QueryServer, in place. QueryServer.apply_settings would rebuild
    the frame store and the request queue, losing the frames held (queries would get no_frames
    until every camera sent again), the per-camera counters and every queued query (the worker
    takes from the new queue, so the old one's would never be answered). Here the queue keeps
    its requests: shrunk below its depth, it refuses new ones (reject_new) or answers its oldest
    queue_full (drop_oldest) until the worker has served it down; nothing goes unanswered."""
    server.settings = settings
    server.frames.max_skew_ns = int(settings.max_skew_s * 1e9)
    server.frames.max_age_ns = int(settings.max_frame_age_s * 1e9)
    server.queue.size, server.queue.policy = settings.queue_size, settings.overflow_policy


class CameraMonitor:
    """Per camera, for /diagnostics: arrival rate, the newest frame's stamp, and frames DDS
    reported lost (best-effort sensor QoS drops silently otherwise)."""

    WINDOW_S = 5.0

    def __init__(self):
        self.arrivals = {c: deque(maxlen=100) for c in CAMERAS}   # monotonic s
        self.newest_ns = {c: 0 for c in CAMERAS}
        self.lost = {c: 0 for c in CAMERAS}
        self.undecodable = {c: 0 for c in CAMERAS}     # stored frames whose header says bad_image if selected
        self.last_defect = {c: "" for c in CAMERAS}    # the newest frame's defect ("": it was fine)
        self.renewals = {c: 0 for c in CAMERAS}        # readers renewed after a publisher left (DDS memory)

    def frame(self, camera: str, stamp_ns: int) -> None:
        self.arrivals[camera].append(time.monotonic())
        self.newest_ns[camera] = max(self.newest_ns[camera], stamp_ns)

    def rate_hz(self, camera: str) -> float:
        now = time.monotonic()
        recent = [t for t in self.arrivals[camera] if now - t <= self.WINDOW_S]
        return (len(recent) - 1) / (recent[-1] - recent[0]) if len(recent) >= 2 and recent[-1] > recent[0] else 0.0


class DriveNode(LifecycleNode):
    def __init__(self, node_name: str = NODE_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        self.refused = declare_parameters(self)           # start values refused (or unknown): configure fails on them
        self.config_error = ""
        self.settings = NodeSettings()                      # configure replaces it by the validated values
        self.model_name = model_label(str(self.get_parameter("model_dir").value))
        self.server = QueryServer(self.settings.server_settings(CAMERAS), self._publish, clock_ns=self._now_ns,
                                  publish_partial=self._publish_partial)
        self.cameras = CameraMonitor()
        self.answer_pub = self.create_publisher(Answer, ANSWER, RELIABLE)
        self.answer_json_pub = self.create_publisher(String, ANSWER_JSON, RELIABLE)
        self.partial_pub = self.create_publisher(AnswerPartial, ANSWER_PARTIAL, RELIABLE)
        self.diag_pub = self.create_publisher(DiagnosticArray, DIAGNOSTICS, 10)
        self.create_subscription(Query, QUERY, self._on_query, QUERY_QOS)
        self.create_subscription(String, QUESTION, self._on_question, QUERY_QOS)
        self._diag_timer = self.create_timer(float(self.get_parameter("diagnostics_period_s").value),
                                             self._publish_diagnostics)
        self.create_timer(0.01, self._every_10ms)
        self.add_on_set_parameters_callback(self._check_parameters)
        self.add_post_set_parameters_callback(self._apply_parameters)
        self._camera_subs = []
        self._renew_cameras: set[str] = set()     # cameras whose reader a departed publisher left holding memory
        self._state = "unconfigured"
        self.max_pixels = int(self.get_parameter("images.max_pixels").value)   # configure sets the validated one
        self.integrity = "not loaded"        # integrity_label of the loaded model folder

    def destroy_node(self) -> None:
        super().destroy_node()
        # rclpy's LifecycleNode leaves its lifecycle state machine alive, and the state machine
        # holds the rcl node and so the DDS participant: the participant's shared-memory segments
        # (the transport's 32 MB segment, every writer's data-sharing pool) then outlive the
        # process in /dev/shm, 35 MB per run of the node until the machine reboots (measured;
        # tests/test_ros_shutdown.py checks that a stopped node leaves none).
        self._state_machine.destroy_when_not_in_use()

    def _every_10ms(self) -> None:
        self.server.retry_pending()          # queries waiting for frames in flight
        self.server.expire_deadlines()       # queued queries answered deadline_passed on time
        if self._renew_cameras:
            self._renew_readers()

    def values(self) -> dict:
        return {name: self.get_parameter(name).value for name in all_settings()}

    def _now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    # ---- parameters (`ros2 param set`) ----
    def _check_parameters(self, params) -> SetParametersResult:
        configured = self._state != "unconfigured"      # inactive, active (or finalized)
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
        if not live:
            return
        self.settings = replace(self.settings, **live)
        apply_live(self.server, self.settings.server_settings(CAMERAS))
        self.get_logger().info("parameters applied live: " + ", ".join(f"{k}={v!r}" for k, v in live.items()))

    # ---- lifecycle ----
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        values = self.values()
        try:
            if self.refused:
                raise InputError("; ".join(self.refused.values()))
            settings, options = validate_values(values)
        except InputError as exc:
            return self._configure_failed(f"bad parameter: {exc}")
        self.settings = settings
        self.max_pixels = options.images.max_pixels
        self.server.apply_settings(settings.server_settings(CAMERAS))   # nothing is queued before activate
        if self._diag_timer.timer_period_ns != int(settings.diagnostics_period_s * 1e9):
            self.destroy_timer(self._diag_timer)
            self._diag_timer = self.create_timer(settings.diagnostics_period_s, self._publish_diagnostics)

        model_dir = settings.model_dir or str(DEFAULT_MODEL)      # "": the bundled default model
        self.model_name = model_label(settings.model_dir)
        self.get_logger().info(f"configure: loading {model_dir} (pipeline {options.pipeline.value}, backend "
                               f"{options.backend.name.value}, {options.device}, {options.dtype})")

        def factory():
            refused = require_manifest_error(model_dir) if settings.require_manifest else None
            if refused:
                raise CheckpointError(refused)
            return Pipeline.from_pretrained(model_dir, options)
        try:
            self.server.load(factory, warmup=settings.warmup)
        except Exception as exc:  # noqa: BLE001 - the node stays up and says why in every answer
            return self._configure_failed(f"{type(exc).__name__}: {exc}")
        self.integrity = integrity_label(model_dir)
        self.config_error = ""
        self._state = "inactive"
        self.get_logger().info(f"configure: model loaded and warmed up; serving {self.server.pipeline.options.label()}; "
                               f"integrity: {self.integrity}")
        return TransitionCallbackReturn.SUCCESS

    def _configure_failed(self, why: str) -> TransitionCallbackReturn:
        self.config_error = why
        self._state = "unconfigured"
        self.get_logger().error(f"configure failed: {why}")
        self._publish_diagnostics()
        return TransitionCallbackReturn.FAILURE

    def _subscribe_camera(self, cam: str, topic: str):
        msg_type = message_type_of(self.resolve_topic_name(topic))   # after namespace and remaps
        events = SubscriptionEventCallbacks(message_lost=lambda info, c=cam: self._on_lost(c, info),
                                            matched=lambda info, c=cam: self._on_matched(c, info))
        return self.create_subscription(msg_type, topic, lambda m, c=cam: self._on_image(c, m),
                                        qos_profile_sensor_data, event_callbacks=events)

    def _on_matched(self, camera: str, info) -> None:
        """A publisher of this camera left: renew the camera's DDS reader (at the next 10 ms tick).
        Fast DDS 3.2 keeps a best-effort sample whose fragments were lost (a 192 MB frame on a
        loaded machine) in the reader until that writer's next fragmented sample, and for good once
        the writer is gone; deleting the reader frees it (docs/ros.md, "DDS reassembly memory")."""
        if info.current_count_change < 0:
            self._renew_cameras.add(camera)

    def _renew_readers(self) -> None:
        for cam in sorted(self._renew_cameras):
            i = CAMERAS.index(cam)
            if self._state == "active" and i < len(self._camera_subs):
                self.destroy_subscription(self._camera_subs[i])
                self._camera_subs[i] = self._subscribe_camera(cam, self.settings.camera_topics[i])
                self.cameras.renewals[cam] += 1
                self.get_logger().info(f"{cam}: a publisher left; reader renewed (frees DDS reassembly buffers)")
        self._renew_cameras.clear()

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        self._camera_subs = [self._subscribe_camera(cam, topic) for cam, topic in zip(CAMERAS, self.settings.camera_topics)]
        self.server.active = True
        self.server.start_worker()
        self._state = "active"
        self.get_logger().info("activate: listening on " + ", ".join(s.topic_name for s in self._camera_subs))
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
        """Drop the model, its arena and caches, and give their memory back (release_memory)."""
        self.server.pipeline = None
        self.integrity = "not loaded"
        freed = release_memory()
        self._state = "unconfigured"
        self.get_logger().info(f"cleanup: model released (RSS {freed})")
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        self.server.shutdown()      # queued queries answered shutting_down, the running one finishes
        self._state = "finalized"
        return TransitionCallbackReturn.SUCCESS

    # ---- callbacks (executor thread: cheap work only) ----
    def _on_image(self, camera: str, msg) -> None:
        """A CompressedImage or Image: kept undecoded until a query selects this camera. A raw
        frame above images.max_pixels is refused from its header before it is copied or stored;
        every frame's header is checked (frame_health) so that a camera sending undecodable
        frames shows on /diagnostics whether or not a query selects it."""
        refused = too_large(camera, msg, self.max_pixels, self.server.frames.max_bytes)
        if refused:
            self.server.frames.refuse(camera, refused)
            return
        payload = payload_from_msg(msg)
        defect = header_defect(camera, payload, self.max_pixels)
        self.cameras.last_defect[camera] = defect or ""
        if defect:
            self.cameras.undecodable[camera] += 1
        self._add_frame(camera, ns_of(msg.header.stamp), payload)

    def _add_frame(self, camera: str, stamp_ns: int, payload) -> None:
        self.server.frame_delay_ms.append((self._now_ns() - stamp_ns) / 1e6)
        self.cameras.frame(camera, stamp_ns)
        self.server.frames.add(Frame(camera, stamp_ns, payload))

    def _on_lost(self, camera: str, info) -> None:
        self.cameras.lost[camera] += int(info.total_count_change)

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
        self.server.submit(msg.text, query_id=msg.id, stamp_ns=ns_of(msg.header.stamp), deadline_ns=ns_of(msg.deadline),
                           budget_ms=float(msg.budget_ms), choices=list(msg.choices),
                           answer_schema=str(msg.answer_schema), temperature=float(msg.temperature),
                           seed=int(msg.seed), follow_up_of=str(msg.follow_up_of))

    def _on_question(self, msg: String) -> None:
        self.server.submit(msg.data)

    # ---- output (worker thread or executor thread) ----
    def _publish_partial(self, partial: PartialRecord) -> None:
        msg = AnswerPartial(query_id=partial.query_id, text=partial.text, token_count=partial.token_count,
                            final=partial.final)
        msg.header.stamp = self.get_clock().now().to_msg()
        self.partial_pub.publish(msg)

    def _publish(self, rec: AnswerRecord) -> None:
        self.answer_pub.publish(record_to_msg(rec))
        self.answer_json_pub.publish(String(data=json.dumps(rec.to_json())))
        # (rclpy's logger wants one severity per call site, hence two calls.)
        if rec.status == "ok":
            self.get_logger().info(f"{rec.query_id} [ok] {rec.total_ms:.1f} ms: {rec.answer[:80]!r}")
        else:
            self.get_logger().warning(f"{rec.query_id} [{rec.status}] {rec.status_message}")

    def camera_values(self, s: dict) -> tuple[dict, list[str]]:
        """Per camera: topic, arrival rate, age of the newest frame, received, dropped (the frame
        store's duplicates/too-old plus what DDS reported lost); and the cameras gone stale."""
        now, values, stale = self._now_ns(), {}, []
        topics = [sub.topic_name for sub in self._camera_subs] or list(self.settings.camera_topics)
        for cam, topic in zip(CAMERAS, topics):
            newest = self.cameras.newest_ns[cam]
            age = (now - newest) / 1e9 if newest else None
            values[f"camera.{cam}.topic"] = topic
            values[f"camera.{cam}.rate_hz"] = f"{self.cameras.rate_hz(cam):.2f}"
            values[f"camera.{cam}.newest_frame_age_s"] = f"{age:.3f}" if age is not None else "no frame yet"
            values[f"camera.{cam}.received"] = s["frames_received"][cam]
            values[f"camera.{cam}.dropped"] = s["frames_dropped"][cam] + self.cameras.lost[cam]
            values[f"camera.{cam}.bad_stamp"] = s["frames_bad_stamp"][cam]
            values[f"camera.{cam}.history_resets"] = s["frames_history_resets"][cam]
            values[f"camera.{cam}.too_large"] = s["frames_bad_image"][cam]
            values[f"camera.{cam}.held_mb"] = f"{s['frames_held_bytes'][cam] / 1e6:.2f}"
            values[f"camera.{cam}.memory_evictions"] = s["frames_memory_evictions"][cam]
            values[f"camera.{cam}.reader_renewals"] = self.cameras.renewals[cam]
            values[f"camera.{cam}.undecodable"] = self.cameras.undecodable[cam]
            if age is None or age > self.settings.max_frame_age_s:
                stale.append(cam)
        return values, stale

    def undecodable_cameras(self) -> list[str]:
        """Cameras whose newest frame is undecodable by its header, with their count and why.
        (A camera with only too-large frames has no frame stored: it shows as stale.)"""
        return [f"{cam} ({self.cameras.undecodable[cam]} so far; newest: {self.cameras.last_defect[cam]})"
                for cam in CAMERAS if self.cameras.last_defect[cam]]

    def _publish_diagnostics(self) -> None:
        s = self.server.stats()
        cameras, stale = self.camera_values(s)
        status = DiagnosticStatus(name=f"{self.get_fully_qualified_name()}: vision-language node",
                                  hardware_id=str(self.get_parameter("device").value))
        if self.server.load_error:
            status.level, status.message = DiagnosticStatus.ERROR, f"model not loaded: {self.server.load_error}"
        elif self.config_error:
            status.level, status.message = DiagnosticStatus.ERROR, f"configure failed: {self.config_error}"
        elif self._state != "active":
            status.level, status.message = DiagnosticStatus.WARN, f"lifecycle state {self._state}"
        elif stale:
            status.level, status.message = DiagnosticStatus.WARN, (
                f"serving, but no fresh frame from {', '.join(stale)} (max_frame_age_s {self.settings.max_frame_age_s:g})")
        elif self.undecodable_cameras():
            status.level, status.message = DiagnosticStatus.WARN, (
                "serving, but undecodable frames from " + "; ".join(self.undecodable_cameras()))
        else:
            status.level, status.message = DiagnosticStatus.OK, f"serving ({s['answered']} answered, {s['errors']} errors)"
        values = {
            "state": self._state,
            "model": self.model_name,
            "integrity": self.integrity,
            "pipeline": self.server.pipeline.options.label() if self.server.pipeline else "",
            "backend": self.get_parameter("backend.name").value,
            "device": self.get_parameter("device").value,
            "dtype": self.get_parameter("dtype").value,
            "configure_error": self.config_error,
            "queue_depth": s["queue_depth"],
            "queue_size": s["queue_size"],
            "waiting_for_frames": s["waiting_for_frames"],
            "overflow_policy": s["overflow_policy"],
            "answered": s["answered"],
            "errors": s["errors"],
            "last_error": s["last_error"],
            "dropped_frames": sum(s["frames_dropped"].values()) + sum(self.cameras.lost.values()),
            "frame_memory_mb": f"{self.server.settings.frame_memory_mb:g}",
            "bad_stamp_frames": sum(s["frames_bad_stamp"].values()),
            "publish_failed": s["publish_failed"],
            "conversations": s["conversations"],
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
        values.update(cameras)
        status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
        arr = DiagnosticArray(status=[status])
        arr.header.stamp = self.get_clock().now().to_msg()
        self.diag_pub.publish(arr)


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
    for pub in (node.answer_pub, node.answer_json_pub, node.partial_pub):
        if executor.context.ok() and not pub.wait_for_all_acked(Duration(seconds=ack_timeout_s)):
            node.get_logger().warning(f"{pub.topic_name}: not every subscriber acknowledged within {ack_timeout_s:.0f} s")
    node.log_summary()
    executor.remove_node(node)
    executor.shutdown()
    node.destroy_node()
    if rclpy.ok():
        rclpy.shutdown()


# A second SIGINT this soon after the first is the same Ctrl-C, forwarded by ros2 launch.
REPEATED_SIGINT_S = 1.0


def run_node(args: list[str], node_name: str = NODE_NAME, self_drive: bool = True) -> int:
    """Start the node with these command-line arguments and spin until SIGINT or SIGTERM, then
    drain (drain_and_close). With self_drive (`litevlm drive`) the node takes itself through
    configure and activate, as the launch file does under `ros2 launch`. A failed configure keeps
    the node up: it answers every query with an error and reports the cause on /diagnostics."""
    # rclpy's own handlers would shut the context down on the signal, before the worker could
    # publish what it owes ("publisher's context is invalid"): the node handles both itself.
    use_profile_memory_policy()
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
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
