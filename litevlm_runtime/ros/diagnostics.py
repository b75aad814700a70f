"""The node's /diagnostics: one DiagnosticStatus with the lifecycle state, the model and pipeline
that serve, the request queue, answer counts, per-stage latency percentiles, the explanations
(counts, each part's median cost), and per camera its topic, rate, newest frame's age, drops and
health (what a camera monitor sees).
"""

from __future__ import annotations

import time
from collections import deque

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from ..cameras import CAMERAS
from ..pipeline.answer import STAGES


class CameraMonitor:
    """Per camera, for /diagnostics: arrival rate, the newest frame's stamp, frames DDS reported
    lost (best-effort sensor QoS drops silently otherwise), undecodable frames, reader renewals,
    and the topic its frames come from (the configured one, or image_transport's raw one)."""

    WINDOW_S = 5.0

    def __init__(self):
        self.arrivals = {c: deque(maxlen=100) for c in CAMERAS}   # monotonic s
        self.newest_ns = {c: 0 for c in CAMERAS}
        self.lost = {c: 0 for c in CAMERAS}
        self.undecodable = {c: 0 for c in CAMERAS}     # stored frames whose header says bad_image if selected
        self.last_defect = {c: "" for c in CAMERAS}    # the newest frame's defect ("": it was fine)
        self.renewals = {c: 0 for c in CAMERAS}        # readers renewed after a publisher left (DDS memory)
        self.source = {c: "" for c in CAMERAS}         # the topic its last frame came on

    def frame(self, camera: str, stamp_ns: int, topic: str) -> None:
        self.arrivals[camera].append(time.monotonic())
        self.newest_ns[camera] = max(self.newest_ns[camera], stamp_ns)
        self.source[camera] = topic

    def rate_hz(self, camera: str) -> float:
        now = time.monotonic()
        recent = [t for t in self.arrivals[camera] if now - t <= self.WINDOW_S]
        return (len(recent) - 1) / (recent[-1] - recent[0]) if len(recent) >= 2 and recent[-1] > recent[0] else 0.0

    def undecodable_cameras(self) -> list[str]:
        """Cameras whose newest frame is undecodable by its header, with their count and why.
        (A camera with only too-large frames has no frame stored: it shows as stale.)"""
        return [f"{cam} ({self.undecodable[cam]} so far; newest: {self.last_defect[cam]})"
                for cam in CAMERAS if self.last_defect[cam]]


def camera_values(node, s: dict) -> tuple[dict, list[str]]:
    """Per camera: topic, arrival rate, age of the newest frame, received, dropped (the frame
    store's duplicates/too-old plus what DDS reported lost); and the cameras gone stale."""
    now, values, stale, monitor = node.now_ns(), {}, [], node.cameras
    topics = node.readers.topic_names()
    for cam, topic in zip(CAMERAS, topics):
        newest = monitor.newest_ns[cam]
        age = (now - newest) / 1e9 if newest else None
        values[f"camera.{cam}.topic"] = monitor.source[cam] or topic
        values[f"camera.{cam}.rate_hz"] = f"{monitor.rate_hz(cam):.2f}"
        values[f"camera.{cam}.newest_frame_age_s"] = f"{age:.3f}" if age is not None else "no frame yet"
        values[f"camera.{cam}.received"] = s["frames_received"][cam]
        values[f"camera.{cam}.dropped"] = s["frames_dropped"][cam] + monitor.lost[cam]
        values[f"camera.{cam}.bad_stamp"] = s["frames_bad_stamp"][cam]
        values[f"camera.{cam}.history_resets"] = s["frames_history_resets"][cam]
        values[f"camera.{cam}.too_large"] = s["frames_bad_image"][cam]
        values[f"camera.{cam}.held_mb"] = f"{s['frames_held_bytes'][cam] / 1e6:.2f}"
        values[f"camera.{cam}.held_s"] = f"{s['frames_held_window_ns'][cam] / 1e9:.2f}"    # the window it holds
        values[f"camera.{cam}.memory_evictions"] = s["frames_memory_evictions"][cam]
        values[f"camera.{cam}.reader_renewals"] = monitor.renewals[cam]
        values[f"camera.{cam}.undecodable"] = monitor.undecodable[cam]
        if age is None or age > node.settings.max_frame_age_s:
            stale.append(cam)
    return values, stale


def overall(node, s: dict, stale: list[str]) -> tuple[bytes, str]:
    """The status's level and message: the first of load error, configure error, not active,
    unverified weights (about every answer), stale cameras, undecodable frames; else OK."""
    server = node.server
    if server.load_error:
        return DiagnosticStatus.ERROR, f"model not loaded: {server.load_error}"
    if node.config_error:
        return DiagnosticStatus.ERROR, f"configure failed: {node.config_error}"
    if node.state != "active":
        return DiagnosticStatus.WARN, f"lifecycle state {node.state}"
    if node.integrity.startswith("unverified"):
        return DiagnosticStatus.WARN, (f"serving weights no manifest vouches for ({node.integrity}; require_manifest "
                                       f"off): write one once the files are checked (litevlm checksum)")
    if stale:
        return DiagnosticStatus.WARN, (f"serving, but no fresh frame from {', '.join(stale)} "
                                       f"(max_frame_age_s {node.settings.max_frame_age_s:g})")
    if node.cameras.undecodable_cameras():
        return DiagnosticStatus.WARN, "serving, but undecodable frames from " + "; ".join(
            node.cameras.undecodable_cameras())
    return DiagnosticStatus.OK, f"serving ({s['answered']} answered, {s['errors']} errors)"


def explanation_values(mode: str, stats: dict | None) -> dict:
    """The explainer's (serving/explainer.py): its mode, counts, and each part's median ms."""
    values = {"explain": mode}
    if stats:
        values.update({f"explanations.{k}": stats[k] for k in ("explained", "dropped", "failed", "waiting")})
        values.update({f"explanation_ms.{part}.p50": f"{ms:.2f}" for part, ms in stats["cost_ms_p50"].items()})
    return values


def temporal_values(node, s: dict) -> dict:
    """Frame sets over time: the temporal settings served with, the (camera, frame) views the answers
    encoded and those the feature cache held, whether the idle worker follows new frame sets, and each
    standing question's counts (serving/standing.py)."""
    pipeline, settings = node.server.pipeline, node.server.settings
    temporal = pipeline.options.temporal if pipeline is not None else None
    values = {
        "temporal.frames": temporal.frames if temporal else node.get_parameter("temporal.frames").value,
        "temporal.max_frames": temporal.max_frames if temporal else node.get_parameter("temporal.max_frames").value,
        "temporal.stride_s": f"{temporal.stride_s if temporal else node.get_parameter('temporal.stride_s').value:g}",
        "views_encoded": s["views_encoded"],
        "views_reused": s["views_reused"],
        "following_frame_sets": s["following_frames"],
        "standing_rate_hz": f"{settings.standing_rate_hz:g}",
        "standing_change": f"{settings.standing_change:g}",
        "standing_questions": len(s["standing"]),
    }
    for name, q in s["standing"].items():
        values[f"standing.{name}.question"] = q["question"]
        values[f"standing.{name}.cameras"] = " ".join(q["cameras"])
        values[f"standing.{name}.frames"] = q["frames"]
        for count in ("answered", "unchanged", "preempted", "replaced", "unmatched", "errors"):
            values[f"standing.{name}.{count}"] = q[count]
        values[f"standing.{name}.last_change"] = f"{q['last_change']:.4f}"
        values[f"standing.{name}.last_error"] = q["last_error"]
    return values


def batching_values(pipeline, policy) -> dict:
    """In-flight batching (pipeline/batching.py BatchPolicy): which mode runs and why."""
    if pipeline is None:
        return {"batching": "", "batching_why": ""}
    if pipeline.rt.arena.limits.batch <= 1:
        return {"batching": "off", "batching_why": "serving.max_batch 1 (or a backend without a batched step)"}
    return {"batching": policy.mode, "batching_why": policy.why}


def diagnostic_array(node) -> DiagnosticArray:
    s = node.server.stats()
    cameras, stale = camera_values(node, s)
    status = DiagnosticStatus(name=f"{node.get_fully_qualified_name()}: vision-language node",
                              hardware_id=str(node.get_parameter("device").value))
    status.level, status.message = overall(node, s, stale)
    pipeline = node.server.pipeline
    values = {
        "state": node.state,
        "model": node.model_name,
        "integrity": node.integrity,
        "pipeline": pipeline.options.label() if pipeline else "",
        # what serves: the backend and weight form the pipeline was built with (a parameter set since
        # applies at the next configure)
        # the engines that ran the last configure ("openvino[int8]": backend.compress), else the parameter
        "backend": pipeline.rt.engines.backend if pipeline else node.get_parameter("backend.name").value,
        # the weight form the linears run in (backend.weights), else the parameter
        "weights": (pipeline.rt.weights.kind if pipeline.rt.weights else "float") if pipeline
        else node.get_parameter("backend.weights").value,
        # the low-bit forms' prompt GEMM that ran (backend.lowbit_prefill's auto resolved), "" for other weights
        "lowbit_prefill": (pipeline.rt.weights.prefill or "") if pipeline and pipeline.rt.weights else "",
        # the low-bit forms' path: "kernels", or "reference path: <why>" (a CPU they do not cover), "" for other weights
        "lowbit_kernels": pipeline.rt.weights.kernels if pipeline and pipeline.rt.weights else "",
        "device": node.get_parameter("device").value,
        "dtype": node.get_parameter("dtype").value,
        "configure_error": node.config_error,
        "queue_depth": s["queue_depth"],
        "queue_size": s["queue_size"],
        "waiting_for_frames": s["waiting_for_frames"],
        "overflow_policy": s["overflow_policy"],
        "counted_since": node.counted_since(),        # every count here (and in the summary line)
        "answered": s["answered"],
        "errors": s["errors"],
        "last_error": s["last_error"],
        "dropped_frames": sum(s["frames_dropped"].values()) + sum(node.cameras.lost.values()),
        "frame_memory_mb": f"{node.server.settings.frame_memory_mb:g}",
        "frame_window_s": f"{node.server.settings.frame_window_s:g}",
        "bad_stamp_frames": sum(s["frames_bad_stamp"].values()),
        "publish_failed": s["publish_failed"],
        # callbacks that raised and were survived (runner.py spin_once_surviving_callbacks): a bug to report
        "callback_errors": node.callback_errors,
        "last_callback_error": node.last_callback_error,
        "conversations": s["conversations"],
        "frame_delay_ms.p50": f"{s['frame_delay_ms'][0]:.2f}",
        "frame_delay_ms.p90": f"{s['frame_delay_ms'][1]:.2f}",
    }
    for st, n in s["status_counts"].items():
        values[f"status.{st}"] = n
    for stage in (*STAGES, "total", "queue"):
        if stage in s["latency_ms"]:
            p50, p90, _ = s["latency_ms"][stage]
            values[f"latency_ms.{stage}.p50"] = f"{p50:.2f}"
            values[f"latency_ms.{stage}.p90"] = f"{p90:.2f}"
    values.update(batching_values(pipeline, node.server.batch_policy))
    values.update(temporal_values(node, s))
    values.update(explanation_values(node.server.settings.explain, s["explanations"]))
    values.update(cameras)
    status.values = [KeyValue(key=k, value=str(v)) for k, v in values.items()]
    arr = DiagnosticArray(status=[status])
    arr.header.stamp = node.get_clock().now().to_msg()
    return arr
