"""The soak harness's workload: a bag's frame sets and questions, read once, published in turn."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from rclpy.serialization import deserialize_message

from ..bag.dds import rclpy_type
from ..bag.io import bag_topics, read_bag
from ..cameras import CAMERAS
from ..errors import InputError
from .dds_client import S


@dataclass
class Workload:
    frame_sets: list[dict]           # camera -> (rclpy message, offset_ns within the set)
    questions: list[str]


def workload_from_bag(bag: Path, params: dict) -> Workload:
    topics = dict(zip(params["camera_topics"], CAMERAS))
    types = bag_topics(bag)
    per_camera: dict[str, list] = defaultdict(list)
    questions: list[str] = []
    wanted = [*topics, params["query_topic"], params["question_topic"]]
    for _, topic, msgtype, raw, reader in read_bag(bag, wanted):
        if topic in topics:              # published as they are: rclpy messages
            per_camera[topics[topic]].append(deserialize_message(raw, rclpy_type(msgtype)))
        else:                            # only the text is used: read with the bag's own definition
            msg = reader.deserialize(raw, msgtype)
            questions.append(msg.text if topic == params["query_topic"] else msg.data)
    missing = [c for c in CAMERAS if not per_camera[c]]
    if missing:
        raise InputError(f"{bag}: no frames on the node's camera topics for {', '.join(missing)} "
                         f"(the bag has {', '.join(types)})")
    if not questions:
        raise InputError(f"{bag}: no questions on {params['query_topic']} or {params['question_topic']}")
    n = min(len(v) for v in per_camera.values())
    sets = []
    for k in range(n):
        stamps = {c: per_camera[c][k].header.stamp.sec * S + per_camera[c][k].header.stamp.nanosec for c in CAMERAS}
        newest = max(stamps.values())
        sets.append({c: (per_camera[c][k], stamps[c] - newest) for c in CAMERAS})
    return Workload(sets, questions)
