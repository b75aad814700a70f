"""Bounded memory of the node over real DDS: a raw frame too large for images.max_pixels is refused
from its header on arrival (never stored; the query gets bad_image naming the camera) and
lifecycle cycles give back what configure took (model, arena, caches)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import ros_helpers
from ros_helpers import Proc, Rig, RosClient, domain_id, write_params
from test_ros_node import NODE_MAIN, start_node

from litevlm_runtime.ros.topics import SHIPPED_REMAPS

NAME = "/litevlm_drive"


def rss_mb(pid: int, kind: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(kind + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {kind} for {pid}")


def private_mb(pid: int) -> float:
    """The node's own resident memory: RSS without RssShmem, which counts the pages of the
    publisher's shared-memory segment that the node read a sample from (the publisher's memory,
    mapped; the same physical pages)."""
    return rss_mb(pid, "RssAnon") + rss_mb(pid, "RssFile")


def rss_parts(pid: int) -> str:
    return ", ".join(f"{k} {rss_mb(pid, k):.0f}" for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"))


BIG_FRAME_PUBLISHER = """
import time, rclpy
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image
rclpy.init()
node = rclpy.create_node("big_frame")
pub = node.create_publisher(Image, "/cam_front/image_raw", qos_profile_sensor_data)
end = time.monotonic() + 60
while pub.get_subscription_count() == 0 and time.monotonic() < end:
    time.sleep(0.05)
time.sleep(1.0)
big = Image(height=8000, width=8000, encoding="rgb8", step=8000 * 3, data=bytes(8000 * 8000 * 3))
for _ in range(5):      # best effort: a loaded machine can drop fragments of a 192 MB sample
    big.header.stamp = node.get_clock().now().to_msg()
    pub.publish(big)
    time.sleep(1.5)
# Small samples with the same header (also refused, never stored): as on a live camera, newer
# samples make the reader drop the buffers of big ones whose fragments were lost in transit.
for _ in range(3):
    small = Image(height=8000, width=8000, encoding="rgb8", step=8000 * 3)
    small.header.stamp = node.get_clock().now().to_msg()
    pub.publish(small)
    time.sleep(0.3)
node.destroy_node()
rclpy.shutdown()
"""


def big_sample_profile(path: Path) -> Path:
    """The shipped profile with room for one 192 MB best-effort sample in shared memory (its 32 MB
    segment and 512-fragment port queue drop it, so the node would never see the frame)."""
    xml = ros_helpers.PROFILE.read_text().replace("<segment_size>33554432</segment_size>",
                                                  "<segment_size>536870912</segment_size>"
                                                  "<port_queue_capacity>16384</port_queue_capacity>")
    assert "536870912" in xml
    path.write_text(xml)
    return path


def test_oversized_raw_frame_is_refused_on_arrival(tmp_path, tiny_model):
    from diagnostic_msgs.msg import DiagnosticArray
    from std_msgs.msg import String

    domain = domain_id(212)
    profile = big_sample_profile(tmp_path / "big_samples.xml")
    topics = ["cam_front/image_raw", *(f"{c}/image_raw/compressed" for c in
                                       ("cam_front_left", "cam_front_right", "cam_back", "cam_back_left", "cam_back_right"))]
    params = write_params(tmp_path / "p.yaml", model_dir=str(tiny_model), warmup=False, max_new_tokens=2,
                          camera_topics=topics, match_wait_s=0.0)
    env = ros_helpers.ros_env(domain)
    env.update(FASTDDS_DEFAULT_PROFILES_FILE=str(profile), RMW_FASTRTPS_USE_QOS_FROM_XML="1")
    remaps = [a for src, dst in SHIPPED_REMAPS for a in ("-r", f"{src}:={dst}")]
    node = Proc([], env, tmp_path / "node.log", cmd=[sys.executable, "-c", NODE_MAIN, "--ros-args", "--params-file",
                                                     str(params), *remaps])
    client = RosClient(domain)          # small samples only: its process may hold an earlier profile
    try:
        assert client.lifecycle_set(NAME, "configure") and client.lifecycle_set(NAME, "activate")
        rig = Rig(client)
        diags, answers = [], []
        client.node.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
        client.node.create_subscription(String, "/litevlm/answer_json", lambda m: answers.append(json.loads(m.data)),
                                        10)
        assert client.spin_until(lambda: rig.query.get_subscription_count() > 0, 30)
        client.spin_for(1.0)
        before = private_mb(node.p.pid)
        print("before:", rss_parts(node.p.pid))
        rig.frames(1)          # the five compressed cameras (and a compressed cam_front nobody hears)
        # The 192 MB frame from a process of its own: Fast DDS reads its XML profile once per
        # process, so this one's big shared-memory segment holds whatever earlier tests loaded.
        publisher = Proc([], env, tmp_path / "big.log", cmd=[sys.executable, "-c", BIG_FRAME_PUBLISHER])
        assert publisher.wait(120) == 0, publisher.text()
        assert client.spin_until(lambda: diags and int({kv.key: kv.value for kv in diags[-1].status[0].values}.get(
            "camera.CAM_FRONT.too_large", "0")) >= 1, 60), "the 8000x8000 frame never arrived (5 sent)"
        client.spin_for(1.0)
        growth = private_mb(node.p.pid) - before
        print("after:", rss_parts(node.p.pid))
        rig.ask("big", "Is there a car in front?")
        assert client.spin_until(lambda: answers, 30)
        a = answers[0]
        assert a["status"] == "bad_image" and a["status_message"].startswith("CAM_FRONT: image is 8000x8000"), a
        assert "images.max_pixels" in a["status_message"] and "refused on arrival" in a["status_message"]
        print(f"private RSS growth after an 8000x8000 rgb8 frame (192 MB): {growth:.1f} MB")
        values = {kv.key: kv.value for kv in diags[-1].status[0].values}
        assert values["camera.CAM_FRONT.newest_frame_age_s"] == "no frame yet"       # never stored
        # RSS is printed, not asserted: a sample that arrives whole costs the node +2.6-3.1 MB (6
        # runs), but when Fast DDS loses fragments of one of the 5 best-effort sends (a loaded
        # machine) it keeps that incomplete sample's buffer (+58, +104, +157 MB seen). That is
        # DDS's reassembly memory, not the node's storage (asserted empty above), and it is not
        # bounded yet (docs/ros.md, the issue-21 report).

        # Camera health whatever a query selects: a frame that is not JPEG/PNG is counted on arrival.
        from sensor_msgs.msg import CompressedImage

        bad = CompressedImage(format="jpeg", data=b"GIF89a not a camera frame")
        bad.header.stamp = client.node.get_clock().now().to_msg()
        rig.cameras["CAM_BACK"].publish(bad)
        assert client.spin_until(lambda: diags and {kv.key: kv.value for kv in diags[-1].status[0].values}.get(
            "camera.CAM_BACK.undecodable") == "1", 30)
        st = diags[-1].status[0]
        assert "CAM_BACK (1 so far; newest: CAM_BACK: CompressedImage is neither JPEG nor PNG" in st.message or \
            "no fresh frame" in st.message, st.message
    finally:
        client.close()
        node.stop()


@pytest.mark.parametrize("model", ["tiny", pytest.param("bundled", marks=pytest.mark.slow)])
def test_lifecycle_cycles_keep_memory_flat(tmp_path, tiny_model, model):
    """20 deactivate/cleanup/configure/activate cycles, each answering a query: RSS within +5%
    of the RSS after the first (the tiny model in CI; the bundled one, 4 minutes, outside)."""
    domain = domain_id(213)
    params = write_params(tmp_path / "p.yaml", model_dir=str(tiny_model) if model == "tiny" else "", warmup=True,
                          max_new_tokens=2 if model == "tiny" else 16)
    node = start_node(tmp_path, domain, "/", params)
    client = RosClient(domain)
    try:
        rig = Rig(client)
        rss = []
        for cycle in range(int(os.environ.get("LITEVLM_TEST_CYCLES", "21"))):
            if cycle:
                assert client.lifecycle_set(NAME, "deactivate") and client.lifecycle_set(NAME, "cleanup")
            assert client.lifecycle_set(NAME, "configure") and client.lifecycle_set(NAME, "activate")
            assert client.spin_until(rig.connected, 30)
            rig.frames(cycle)
            client.spin_for(0.3)
            rig.ask(f"c{cycle}", "Is there a car in front?")
            assert client.spin_until(lambda: any(a.query_id == f"c{cycle}" for a in rig.answers), 60), cycle
            assert rig.answers[-1].status == 0, rig.answers[-1].status_message
            rss.append(rss_mb(node.p.pid))
        print("RSS per cycle (MB): " + " ".join(f"{r:.0f}" for r in rss))
        assert rss[-1] <= rss[0] * 1.05, rss
    finally:
        client.close()
        node.stop()
