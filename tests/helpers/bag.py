"""Bags written by other tools, and the node parameters on the tiny model, shared by the bag tests
(tests/bag/test_bag.py) and the InternVL3.5 pipeline's bag test (tests/models/test_qwen3_pipeline.py)."""

import io

import numpy as np
from PIL import Image

from helpers import ros2_msgdef
from litevlm_runtime.bag.io import camera_topic, msg_definitions_dir
from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.ros.params_file import load_node_params


def tiny_params(tiny_model, **over):
    values = {"model_dir": str(tiny_model), "warmup": "false", "max_new_tokens": "2"}
    return load_node_params(None, values | over)


QUERY_MSG = msg_definitions_dir() / "Query.msg"
TF_MESSAGE = {"tf2_msgs/msg/TFMessage": "geometry_msgs/TransformStamped[] transforms"}   # not installed here


def stamp(ns):
    return {"sec": ns // 10**9, "nanosec": ns % 10**9}


def mcap_ros2_bag(path, frames, t0=1_700_000_000 * 10**9):
    """A bare .mcap written with mcap + mcap-ros2-support (their own CDR encoder, not rosbags):
    six cameras as image_transport publishes them ("rgb8; jpeg compressed bgr8"), /tf, /imu and
    two questions on /litevlm/query."""
    from mcap_ros2.writer import Writer

    with open(path, "wb") as fh:
        w = Writer(fh)
        image = w.register_msgdef("sensor_msgs/msg/CompressedImage", ros2_msgdef("sensor_msgs/msg/CompressedImage"))
        query = w.register_msgdef("litevlm_msgs/msg/Query", ros2_msgdef(
            "litevlm_msgs/msg/Query", {"litevlm_msgs/msg/Query": QUERY_MSG.read_text()}))
        tf = w.register_msgdef("tf2_msgs/msg/TFMessage", ros2_msgdef("tf2_msgs/msg/TFMessage", TF_MESSAGE))
        imu = w.register_msgdef("sensor_msgs/msg/Imu", ros2_msgdef("sensor_msgs/msg/Imu"))
        for k in range(20):                                   # 200 Hz IMU and 20 Hz tf around the frames
            t = t0 + k * 5_000_000
            w.write_message("/imu", imu, {"header": {"stamp": stamp(t), "frame_id": "imu"},
                                          "orientation": {"x": 0.0, "y": 0.0, "z": 0.0, "w": 1.0},
                                          "linear_acceleration": {"x": 0.0, "y": 0.0, "z": 9.81}}, log_time=t)
            if k % 10 == 0:
                w.write_message("/tf", tf, {"transforms": [{"header": {"stamp": stamp(t), "frame_id": "map"},
                                                            "child_frame_id": "base_link"}]}, log_time=t)
        for i, cam in enumerate(CAMERAS):
            t = t0 + 10_000_000 + i * 1_000_000
            w.write_message(camera_topic(cam, raw=False), image,
                            {"header": {"stamp": stamp(t), "frame_id": cam.lower()},
                             "format": "rgb8; jpeg compressed bgr8", "data": frames[cam]}, log_time=t)
        for j, text in enumerate(("What is in front of the ego car?", "Is there a car behind?")):
            t = t0 + 80_000_000 + j * 10_000_000
            w.write_message("/litevlm/query", query, {"header": {"stamp": stamp(t)}, "id": f"m{j}", "text": text},
                            log_time=t)
        w.finish()
    return path


def jpeg_frames(seed=0, size=(64, 36)):
    rng = np.random.default_rng(seed)
    out = {}
    for cam in CAMERAS:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="JPEG")
        out[cam] = buf.getvalue()
    return out


