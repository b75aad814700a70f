"""The soak harness's DDS side, also what the DDS tests drive the node with: a ROS node in its own
context that publishes camera frames and queries to the node's topics and collects its answers."""

from __future__ import annotations

import json
import threading
import time

import rclpy
from litevlm_msgs.msg import Answer, Query
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String

from ..bag.dds import answer_row
from ..cameras import CAMERAS
from ..errors import InputError
from ..ros.dds_env import use_large_data_profile

S = 1_000_000_000     # nanoseconds per second: message stamps are (sec, nanosec)


class DDSClient:
    """A ROS node in its own context: publishes camera frames and queries to the node's topics
    (its parameters say which) and collects every Answer, spinning in a background thread."""

    def __init__(self, params: dict, domain_id: int | None = None, name: str = "litevlm_soak"):
        use_large_data_profile()
        self.ctx = rclpy.Context()
        rclpy.init(context=self.ctx, domain_id=domain_id, signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node(name, context=self.ctx)
        keep_all = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)
        self.camera_pubs = {}
        for cam, topic in zip(CAMERAS, params["camera_topics"]):
            msg_type = CompressedImage if topic.rstrip("/").endswith("/compressed") else Image
            self.camera_pubs[cam] = self.node.create_publisher(msg_type, topic, QoSProfile(
                depth=10, reliability=ReliabilityPolicy.RELIABLE))
        self.query_pub = self.node.create_publisher(Query, params["query_topic"], keep_all)
        self.answer_topic = params["answer_topic"]
        self._lock = threading.Lock()
        self.rows: list[dict] = []
        self.node.create_subscription(Answer, self.answer_topic, self._on_answer, keep_all)
        # The JSON mirror carries what the typed Answer does not (the pipeline's CPU and GC time).
        self.mirrored: dict[str, dict] = {}
        self.node.create_subscription(String, params["answer_json_topic"], self._on_json, keep_all)
        self.executor = SingleThreadedExecutor(context=self.ctx)
        self.executor.add_node(self.node)
        self._spinner = threading.Thread(target=self._spin, name="litevlm-soak-spin", daemon=True)
        self._spinner.start()

    def _spin(self) -> None:
        while self.ctx.ok():
            try:
                self.executor.spin_once(timeout_sec=0.05)
            except Exception:  # noqa: BLE001 - the context went away under us: done
                if self.ctx.ok():
                    raise
                return

    def _on_answer(self, msg) -> None:
        row = answer_row(msg, time.time_ns())
        with self._lock:
            self.rows.append(row)

    def _on_json(self, msg) -> None:
        d = json.loads(msg.data)
        with self._lock:
            self.mirrored[d["query_id"]] = {k: d[k] for k in ("cpu_ms", "gc_ms") if k in d}

    def now_ns(self) -> int:
        return time.time_ns()

    def answers(self) -> list[dict]:
        """The Answer rows received so far, with the JSON mirror's extra fields where it came."""
        with self._lock:
            return [{**r, **self.mirrored.get(r["query_id"], {})} for r in self.rows]

    def wait_for_node(self, timeout: float = 30.0) -> None:
        """Until the node's query subscription and answer publisher are matched with ours."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if (self.query_pub.get_subscription_count() > 0
                    and self.node.count_publishers(self.answer_topic) > 0
                    and all(p.get_subscription_count() > 0 for p in self.camera_pubs.values())):
                time.sleep(0.3)       # discovery completes on both sides
                return
            time.sleep(0.05)
        raise InputError(f"no node answered on {self.answer_topic} within {timeout:.0f} s")

    def publish_frames(self, frames: dict, stamp_ns: int) -> None:
        """frames: camera -> (sensor_msgs message, offset_ns <= 0 within its set)."""
        for cam, (msg, offset_ns) in frames.items():
            t = stamp_ns + offset_ns
            msg.header.stamp.sec, msg.header.stamp.nanosec = t // S, t % S
            self.camera_pubs[cam].publish(msg)

    def publish_query(self, query_id: str, text: str, stamp_ns: int | None = None, deadline_ns: int = 0) -> None:
        msg = Query(id=query_id, text=text)
        t = self.now_ns() if stamp_ns is None else stamp_ns
        msg.header.stamp.sec, msg.header.stamp.nanosec = t // S, t % S
        if deadline_ns:
            msg.deadline.sec, msg.deadline.nanosec = deadline_ns // S, deadline_ns % S
        self.query_pub.publish(msg)

    def wait_for_answers(self, ids, timeout: float, quiet_s: float = 0.0) -> list[dict]:
        """Until every id in `ids` has an answer (then `quiet_s` more, to see duplicates), or
        `timeout` seconds without a new answer."""
        want = set(ids)
        last_n, last_change = -1, time.monotonic()
        while True:
            rows = self.answers()
            if want <= {r["query_id"] for r in rows}:
                time.sleep(quiet_s)
                return self.answers()
            if len(rows) != last_n:
                last_n, last_change = len(rows), time.monotonic()
            elif time.monotonic() - last_change > timeout:
                return rows
            time.sleep(0.02)

    def close(self) -> None:
        self.node.destroy_node()
        if self.ctx.ok():
            rclpy.shutdown(context=self.ctx)
        self._spinner.join(5)
