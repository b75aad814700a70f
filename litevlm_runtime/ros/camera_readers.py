"""The six cameras' DDS readers of an active node: subscribed at activate, dropped at deactivate,
renewed when a publisher leaves; each frame checked from its header and stored undecoded in the
server's frame store (decoded only when a query selects its camera).

A camera topic whose resolved name (after namespace and remaps) ends in "/compressed" carries
sensor_msgs/CompressedImage, any other sensor_msgs/Image, as image_transport names them. With the
shipped camera_topics each camera's raw `image_raw` is read too, while nobody publishes its
`image_raw/compressed`: the rule `bag eval` applies to a bag's topics, so a raw-image bag replayed
into a default node is answered from the same frames.
"""

from __future__ import annotations

from rclpy.event_handler import SubscriptionEventCallbacks
from rclpy.exceptions import InvalidHandle
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data

from ..cameras import CAMERAS
from ..serving.frame_health import header_defect, too_large
from ..serving.frame_store import Frame
from ..serving.images import payload_from_msg
from ..serving.server import QueryServer
from .bag_types import message_type_of
from .convert import ns_of
from .diagnostics import CameraMonitor
from .topics import DEFAULT_CAMERA_TOPICS

COMPRESSED = "/compressed"


class CameraReaders:
    def __init__(self, node: Node, server: QueryServer, monitor: CameraMonitor):
        self.node, self.server, self.monitor = node, server, monitor
        self.topics: tuple[str, ...] = DEFAULT_CAMERA_TOPICS   # the configured camera_topics
        self.max_pixels = 0                   # images.max_pixels (the node sets it at configure)
        self.subs: dict[str, list] = {}      # camera -> [its configured topic's, the raw fallback's]
        # camera -> its configured topic's resolved name, kept as a string: renew() destroys a
        # subscription on the tick's thread while /diagnostics, on another executor thread, may be
        # reading the names, and a destroyed subscription's topic_name raises (InvalidHandle; once
        # that ended the node's spin when a bag's publishers left)
        self.resolved: dict[str, str] = {}
        # camera -> why its reader is to be renewed (a departed publisher, or a refused huge frame, left
        # it holding memory)
        self.to_renew: dict[str, str] = {}

    def subscribe(self, topics) -> list[str]:
        """Subscribe every camera to its topic (activate); the resolved names subscribed."""
        self.topics = tuple(topics)
        self.subs = {cam: self._subscribe(cam, topic) for cam, topic in zip(CAMERAS, self.topics)}
        return [s.topic_name for subs in self.subs.values() for s in subs]

    def unsubscribe(self) -> None:
        for subs in self.subs.values():
            for sub in subs:
                self.node.destroy_subscription(sub)
        self.subs, self.resolved = {}, {}

    def topic_names(self) -> list[str]:
        """Each camera's configured topic, resolved once subscribed."""
        return [self.resolved.get(c, t) for c, t in zip(CAMERAS, self.topics)]

    def _subscribe(self, cam: str, topic: str) -> list:
        """The camera's subscription to `topic`; with the shipped camera_topics also to the raw
        image_raw beside its image_raw/compressed, taken only while the compressed one has no
        publisher (what `bag eval` does with a bag's topics)."""
        # after namespace and remaps (as /diagnostics shows it)
        self.resolved[cam] = self.node.resolve_topic_name(topic)
        subs = [self._subscription(cam, self.resolved[cam], None)]
        if self.topics == DEFAULT_CAMERA_TOPICS and topic.endswith(COMPRESSED):
            raw = self.node.resolve_topic_name(topic[:-len(COMPRESSED)])
            subs.append(self._subscription(cam, raw, self.resolved[cam]))
        return subs

    def _subscription(self, cam: str, topic: str, preferred: str | None):
        """`topic` resolved; `preferred`: the resolved topic whose publishers take precedence."""
        events = SubscriptionEventCallbacks(message_lost=lambda info, c=cam: self._on_lost(c, info),
                                            matched=lambda info, c=cam: self._on_matched(c, info))
        sub = self.node.create_subscription(message_type_of(topic), topic,
                                            lambda m, c=cam, t=topic: self.on_image(c, m, t, preferred),
                                            qos_profile_sensor_data, event_callbacks=events)
        sub.litevlm_route = (cam, topic, preferred)       # (take_held)
        return sub

    def take_held(self, limit: int = 16) -> int:
        """Take the frames the camera readers hold now (up to `limit` per reader), as their callbacks
        would. The node calls it before it re-matches the queries waiting for frames: a frame that
        has arrived but waits behind a flood of queries in the executor is no frame "still in
        flight", and a query whose match_wait_s ended then would be matched without it."""
        taken = 0
        for subs in self.subs.values():
            for sub in subs:
                cam, topic, preferred = sub.litevlm_route
                for _ in range(limit):
                    try:
                        with sub.handle:
                            got = sub.handle.take_message(sub.msg_type, sub.raw)
                    except InvalidHandle:            # renewed meanwhile
                        break
                    if got is None:
                        break
                    self.on_image(cam, got[0], topic, preferred)
                    taken += 1
        return taken

    def _on_matched(self, camera: str, info) -> None:
        """A publisher of this camera left: renew the camera's DDS reader (at the next 10 ms tick).
        Fast DDS 3.2 keeps a best-effort sample whose fragments were lost (a 192 MB frame on a
        loaded machine) in the reader until that writer's next fragmented sample, and for good once
        the writer is gone; deleting the reader frees it (docs/ros.md, "DDS reassembly memory")."""
        if info.current_count_change < 0:
            self.to_renew.setdefault(camera, "a publisher left")

    def renew(self, active: bool) -> None:
        """Renew the readers a departed publisher left holding memory (the node's 10 ms tick)."""
        for cam, why in sorted(self.to_renew.items()):
            if active and cam in self.subs:
                for sub in self.subs[cam]:
                    self.node.destroy_subscription(sub)
                self.subs[cam] = self._subscribe(cam, self.topics[CAMERAS.index(cam)])
                self.monitor.renewals[cam] += 1
                self.node.get_logger().info(f"{cam}: {why}; reader renewed (frees its DDS buffers)")
        self.to_renew.clear()

    def on_image(self, camera: str, msg, topic: str, preferred) -> None:
        """A CompressedImage or Image: kept undecoded until a query selects this camera. A raw
        frame above images.max_pixels is refused from its header before it is copied or stored;
        every frame's header is checked (frame_health) so that a camera sending undecodable
        frames shows on /diagnostics whether or not a query selects it. A fallback frame (raw,
        `preferred` the compressed topic's name) is dropped while the compressed topic is served."""
        if preferred is not None and self.node.count_publishers(preferred) > 0:
            return
        frames = self.server.frames
        refused = too_large(camera, msg, self.max_pixels, frames.max_bytes)
        if refused:
            frames.refuse(camera, refused)
            # The reader's own buffers grew to hold the sample (rmw_fastrtps' default reader memory
            # policy, PREALLOCATED_WITH_REALLOC, keeps the largest sample's for good: +185 MB after one
            # 8000x8000 frame, with no profile); a new reader frees them (docs/ros.md).
            self.to_renew.setdefault(camera, "a frame too large to keep was refused")
            return
        payload = payload_from_msg(msg)
        defect = header_defect(camera, payload, self.max_pixels)
        self.monitor.last_defect[camera] = defect or ""
        if defect:
            self.monitor.undecodable[camera] += 1
        stamp = ns_of(msg.header.stamp)
        self.server.frame_delay_ms.append((self.node.get_clock().now().nanoseconds - stamp) / 1e6)
        self.monitor.frame(camera, stamp, topic)
        frames.add(Frame(camera, stamp, payload))

    def _on_lost(self, camera: str, info) -> None:
        self.monitor.lost[camera] += int(info.total_count_change)
