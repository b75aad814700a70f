"""What the bag says about its topics, used where the parameters do not say it.

  camera_topics_from_bag   `camera_topics` not set (the shipped default): each camera's topic is
                           the image topic the bag has for it (raw sensor_msgs/Image or
                           CompressedImage; the type comes from the bag, not the name)
  published_name           `bag replay --namespace NS --remap FROM:=TO`: where a bag topic is
                           published, so that a namespaced or remapped node is fed
  message_type_of          the node's rule for a camera subscription: the type follows the
                           resolved topic (after namespace and remaps), not the parameter's text
  checked_folder           require_manifest for `bag eval`, as the node applies it
"""

from __future__ import annotations

from ..cameras import CAMERAS
from ..errors import CheckpointError, InputError
from ..weights.integrity import require_manifest_error
from .topics import DEFAULT_CAMERA_TOPICS, shipped_topic_names

IMAGE_TYPES = ("sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage")


def camera_topics_from_bag(params: dict, topics: dict[str, str], progress=print) -> dict:
    """`params` with camera_topics taken from the bag (topic -> msgtype) when they are the
    default and the bag lacks the default names: per camera, its configured topic when the bag
    has it, else the bag's one image topic under /<camera>/ (e.g. /cam_front/image_raw). Set
    camera_topics explicitly and they are used as given."""

    default = list(shipped_topic_names(list(DEFAULT_CAMERA_TOPICS))["camera_topics"])
    chosen = list(params["camera_topics"])
    if chosen != default or all(t in topics for t in chosen):
        return params
    for i, cam in enumerate(CAMERAS):
        if chosen[i] in topics:
            continue
        mine = sorted(
            t for t, msgtype in topics.items() if msgtype in IMAGE_TYPES and f"/{cam.lower()}/" in f"{t.lower()}/"
        )
        if len(mine) > 1:
            raise InputError(f"{cam}: the bag has {len(mine)} image topics for it ({', '.join(mine)}): "
                             "set camera_topics to choose")
        if mine:
            progress(f"{cam}: {mine[0]} ({topics[mine[0]]}) from the bag")
            chosen[i] = mine[0]
    return params | {"camera_topics": chosen}


def parse_remaps(rules: list[str]) -> list[tuple[str, str]]:
    out = []
    for rule in rules or ():
        src, sep, dst = rule.partition(":=")
        if not sep or not src or not dst:
            raise InputError(f"--remap {rule!r}: write FROM:=TO (e.g. /cam_front/image_raw:=/front/image)")
        out.append((src, dst))
    return out


def published_name(topic: str, namespace: str = "", remaps: list[tuple[str, str]] = ()) -> str:
    """A bag topic (absolute, as recorded) -> the name it is published under: the first remap whose
    FROM is the topic wins (an absolute TO as it is, a relative one under the namespace), else the
    topic moved under the namespace."""
    ns = "/" + namespace.strip("/") if namespace.strip("/") else ""
    for src, dst in remaps:
        if src == topic or src == topic.lstrip("/"):
            return dst if dst.startswith("/") else f"{ns}/{dst}"
    return f"{ns}{topic}" if topic.startswith("/") else f"{ns}/{topic}"


def message_type_of(resolved_topic: str):
    """sensor_msgs CompressedImage for a resolved name ending in /compressed, else Image."""
    # Imported here: `bag eval` and `bag make` read this module where no ROS 2 is sourced (rosbags only);
    # only the node's camera subscriptions need the message classes.
    from sensor_msgs.msg import CompressedImage, Image

    return CompressedImage if resolved_topic.rstrip("/").endswith("/compressed") else Image


def checked_folder(model_dir: str, require_manifest: bool) -> None:
    """CheckpointError when require_manifest is on and a folder of the model has no manifest
    (`bag eval` refuses what the node with the same parameters would)."""

    refused = require_manifest_error(model_dir) if require_manifest else None
    if refused:
        raise CheckpointError(refused)
