"""Two faults seen once when a replayed bag's publishers left while /diagnostics was published:
the camera readers renewed a subscription on one executor thread while the diagnostics timer,
on another, read the destroyed subscription's topic name (InvalidHandle), and rclpy's
MultiThreadedExecutor re-raised that in spin_once, which ended the node with queries still to
come. Both on a real rclpy node and executor, in this process."""

from __future__ import annotations

import time

from helpers.ros import RosClient, domain_id

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.ros.diagnostics import CameraMonitor
from litevlm_runtime.ros.topics import DEFAULT_CAMERA_TOPICS
from litevlm_runtime.serving.server import QueryServer
from litevlm_runtime.serving.settings import ServerSettings


def test_topic_names_survive_a_subscription_destroyed_by_a_renewal():
    from litevlm_runtime.ros.camera_readers import CameraReaders

    client = RosClient(domain_id(45), name="readers_under_test")
    try:
        readers = CameraReaders(client.node, QueryServer(ServerSettings(), lambda rec: None), CameraMonitor())
        readers.subscribe(DEFAULT_CAMERA_TOPICS)
        names = readers.topic_names()
        assert names == [client.node.resolve_topic_name(t) for t in DEFAULT_CAMERA_TOPICS]
        # the window a renewal leaves: the old subscriptions destroyed, still in the table
        for subs in readers.subs.values():
            for sub in subs:
                client.node.destroy_subscription(sub)
        assert readers.topic_names() == names
        readers.to_renew.update({c: "a test renews it" for c in CAMERAS})
        readers.renew(active=True)
        assert readers.topic_names() == names
        assert all(len(subs) == 2 for subs in readers.subs.values())    # compressed + its raw fallback
        readers.unsubscribe()
        assert readers.topic_names() == list(DEFAULT_CAMERA_TOPICS)     # unsubscribed: as configured
    finally:
        client.close()


def test_a_raising_callback_is_logged_and_the_node_keeps_spinning():
    import rclpy
    from rclpy.executors import MultiThreadedExecutor

    from litevlm_runtime.ros.runner import spin_once_surviving_callbacks

    ctx = rclpy.Context()
    rclpy.init(context=ctx, domain_id=domain_id(46))
    node = rclpy.create_node("raising_timer", context=ctx)
    node.callback_errors, node.last_callback_error = 0, ""
    calls = []

    def tick():
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("a bug in a timer callback")

    node.create_timer(0.02, tick)
    executor = MultiThreadedExecutor(num_threads=2, context=ctx)
    executor.add_node(node)
    try:
        deadline = time.monotonic() + 60
        while len(calls) < 5 and time.monotonic() < deadline:
            spin_once_surviving_callbacks(node, executor)        # never raises the callback's error
        assert len(calls) >= 5, "the timer stopped after its callback raised"
        assert node.callback_errors == 1
        assert node.last_callback_error == "RuntimeError: a bug in a timer callback"
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.shutdown(context=ctx)
