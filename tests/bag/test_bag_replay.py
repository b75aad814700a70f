"""`litevlm bag replay` of a vehicle-like bag over real DDS on loopback.

The bag is a bare .mcap (no metadata.yaml) written with the `mcap` package and rclpy's own CDR
serialization, as a rosbag2 recorder would leave it: six cameras as image_transport publishes
them (best-effort, QoS YAML in the Humble form with numbers), questions (reliable, Jazzy form
with names), /imu, and /tf + /tf_static of a message type that is not installed here. A listener
in this process (its own ROS context and domain) checks what the replayer publishes, and with
which QoS, from the DDS graph.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from helpers import ros2_msgdef
from helpers.ros import domain_id

from litevlm_runtime.bag.ids import split
from litevlm_runtime.bag.io import camera_topic, msg_definitions_dir
from litevlm_runtime.cameras import CAMERAS

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "config" / "fastdds_large_data.xml"
T0 = 1_600_000_000 * 10**9              # 2020: replayed messages are re-stamped to now
CAMERA_TOPICS = [camera_topic(c, raw=False) for c in CAMERAS]


def humble_qos(reliability: int, durability: int) -> str:
    """rosbag2's offered_qos_profiles as Humble writes it: numbers, history 3 ("unknown"), depth 0."""
    never = "\n    sec: 9223372036\n    nsec: 854775807"
    return (f"- history: 3\n  depth: 0\n  reliability: {reliability}\n  durability: {durability}\n"
            f"  deadline:{never}\n  lifespan:{never}\n  liveliness: 1\n  liveliness_lease_duration:{never}\n"
            "  avoid_ros_namespace_conventions: false\n")


def jazzy_qos(reliability: str, durability: str) -> str:
    never = "{sec: 9223372036, nsec: 854775807}"
    return (f"- history: unknown\n  depth: 0\n  reliability: {reliability}\n  durability: {durability}\n"
            f"  deadline: {never}\n  lifespan: {never}\n  liveliness: automatic\n"
            f"  liveliness_lease_duration: {never}\n  avoid_ros_namespace_conventions: false\n")


def vehicle_mcap(path: Path) -> Path:
    import io

    from litevlm_msgs.msg import Query
    from mcap.writer import Writer
    from PIL import Image
    from rclpy.serialization import serialize_message
    from sensor_msgs.msg import CompressedImage, Imu

    def stamp(msg, ns):
        msg.header.stamp.sec, msg.header.stamp.nanosec = ns // 10**9, ns % 10**9
        return msg

    rng = np.random.default_rng(0)
    with path.open("wb") as fh:
        w = Writer(fh)
        w.start(profile="ros2", library="test")

        def channel(topic, msgtype, qos_yaml, extra=None):
            schema = w.register_schema(msgtype, "ros2msg", ros2_msgdef(msgtype, extra).encode())
            return w.register_channel(topic, "cdr", schema, {"offered_qos_profiles": qos_yaml})

        tf_def = {"tf2_msgs/msg/TFMessage": "geometry_msgs/TransformStamped[] transforms"}
        cams = {t: channel(t, "sensor_msgs/msg/CompressedImage", humble_qos(2, 2)) for t in CAMERA_TOPICS}
        query = channel("/litevlm/query", "litevlm_msgs/msg/Query", jazzy_qos("reliable", "volatile"),
                        {"litevlm_msgs/msg/Query": (msg_definitions_dir() / "Query.msg").read_text()})
        imu = channel("/imu", "sensor_msgs/msg/Imu", jazzy_qos("best_effort", "volatile"))
        tf = channel("/tf", "tf2_msgs/msg/TFMessage", humble_qos(1, 2), tf_def)
        tf_static = channel("/tf_static", "tf2_msgs/msg/TFMessage", humble_qos(1, 1), tf_def)
        empty_tf = b"\x00\x01\x00\x00" + b"\x00\x00\x00\x00"    # CDR little-endian, 0 transforms
        w.add_message(tf_static, T0, empty_tf, T0)
        for k in range(5):                                      # 5 frame sets at 4 Hz
            t = T0 + k * 250_000_000
            for i, topic in enumerate(CAMERA_TOPICS):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (36, 64, 3), dtype=np.uint8)).save(buf, format="JPEG")
                msg = stamp(CompressedImage(format="rgb8; jpeg compressed bgr8", data=buf.getvalue()), t + i * 10**6)
                w.add_message(cams[topic], t + i * 10**6, serialize_message(msg), t + i * 10**6)
            w.add_message(tf, t, empty_tf, t)
            w.add_message(imu, t + 5 * 10**6, serialize_message(stamp(Imu(), t + 5 * 10**6)), t + 5 * 10**6)
            q = stamp(Query(id=f"q{k}", text=f"Question {k}?", follow_up_of="q1" if k == 2 else ""), t + 100_000_000)
            w.add_message(query, t + 100_000_000, serialize_message(q), t + 100_000_000)
        w.finish()
    return path


def test_replay_of_a_vehicle_bag(tmp_path, monkeypatch):
    import rclpy
    from litevlm_msgs.msg import Query
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from sensor_msgs.msg import CompressedImage, Imu

    bag = vehicle_mcap(tmp_path / "vehicle.mcap")
    domain = domain_id(4)
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain), FASTDDS_DEFAULT_PROFILES_FILE=str(PROFILE), PYTHONUNBUFFERED="1")
    env.pop("ROS_AUTOMATIC_DISCOVERY_RANGE", None)
    monkeypatch.setenv("FASTDDS_DEFAULT_PROFILES_FILE", str(PROFILE))
    ctx = rclpy.Context()
    rclpy.init(context=ctx, domain_id=domain)
    node = rclpy.create_node("replay_listener", context=ctx)
    got = {"frames": {t: [] for t in CAMERA_TOPICS}, "queries": [], "imu": 0}
    for t in CAMERA_TOPICS:
        node.create_subscription(CompressedImage, t, lambda m, t=t: got["frames"][t].append(m.format),
                                 qos_profile_sensor_data)
    node.create_subscription(Query, "/litevlm/query", lambda m: got["queries"].append(
        (m.id, m.header.stamp.sec, m.follow_up_of)), QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
    node.create_subscription(Imu, "/imu", lambda m: got.__setitem__("imu", got["imu"] + 1), qos_profile_sensor_data)
    publishers = {}                                   # topic -> QoS of the replayer's writer, from the graph
    executor = SingleThreadedExecutor(context=ctx)
    executor.add_node(node)
    done = threading.Event()

    def spin():
        while not done.is_set():
            executor.spin_once(timeout_sec=0.05)
            for t in ("/litevlm/query", CAMERA_TOPICS[0], "/imu", "/tf"):
                for info in node.get_publishers_info_by_topic(t):
                    publishers[t] = info.qos_profile
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        run = subprocess.run([sys.executable, "-m", "litevlm_runtime.cli", "bag", "replay", str(bag), "--all-topics",
                              "--wait", "60"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        time.sleep(0.5)
    finally:
        done.set()
        spinner.join()
        node.destroy_node()
        rclpy.shutdown(context=ctx)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    # The type that is not installed: skipped, one warning for both of its topics.
    skips = [line for line in log.splitlines() if "skipping" in line]
    assert skips == ["replay: skipping /tf, /tf_static: message type tf2_msgs/msg/TFMessage is not installed "
                     "(ModuleNotFoundError: No module named 'tf2_msgs')"], log
    assert "/tf" not in publishers
    # One wait, for the query subscription.
    assert sum("has a subscriber" in line for line in log.splitlines()) == 1
    assert "replay: /litevlm/query has a subscriber" in log
    # Everything else arrived, re-stamped to now, with the recorded QoS.
    assert [split(q[0])[0] for q in got["queries"]] == [f"q{k}" for k in range(5)]     # tagged per replay
    assert len({split(q[0])[1] for q in got["queries"]}) == 1
    assert got["queries"][2][2] == got["queries"][1][0]        # a follow-up names its query as this replay does
    assert all(abs(sec - time.time()) < 120 for _, sec, _ in got["queries"])
    assert all(frames and set(frames) == {"rgb8; jpeg compressed bgr8"} for frames in got["frames"].values()), got
    assert got["imu"] >= 1
    assert publishers[CAMERA_TOPICS[0]].reliability == ReliabilityPolicy.BEST_EFFORT
    assert publishers["/imu"].reliability == ReliabilityPolicy.BEST_EFFORT
    assert publishers["/litevlm/query"].reliability == ReliabilityPolicy.RELIABLE
    assert publishers["/litevlm/query"].durability == DurabilityPolicy.VOLATILE
    assert f"replay: {CAMERA_TOPICS[0]} (sensor_msgs/msg/CompressedImage, 5 messages; QoS best_effort, volatile, " \
           "depth 100, as recorded)" in log
    assert "replay: done, 40 messages" in log          # 30 frames, 5 queries, 5 imu; no tf
