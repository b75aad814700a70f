"""Answers you can see, over real DDS (issue 33): the shipped parameters (`explain: subscribed`) on the
bundled model. With nobody on ~/explanation a query is answered and not explained (/diagnostics
counts none); with a subscriber, three queries asked together (decoded in one batch) give one
picture each, a JPEG of the rig, published after its answer and tied to it by header.frame_id (the
query's id) and header.stamp (the Answer's); `explain: never`, set live, stops them. The Answers carry
their questions' objects as data."""

from __future__ import annotations

import io
import time

from helpers.ros import Proc, Rig, RosClient, domain_id, ros_env
from test_ros_partials import params_with

EXPLANATION_TOPIC = "/litevlm_drive/explanation"       # ~/explanation of the node named litevlm_drive
QUESTIONS = ("What is the status of <c1,CAM_FRONT,800.0,500.0>?", "What is behind the ego car?",
             "Is <c2,CAM_BACK_LEFT,400.0,500.0> moving, and what is <c3,CAM_BAK,1,2>?")


def _diagnostic_values(arrays) -> dict:
    return {kv.key: kv.value for kv in arrays[-1].status[0].values} if arrays else {}


def test_one_picture_per_answered_query_matched_by_id(tmp_path):
    from diagnostic_msgs.msg import DiagnosticArray
    from litevlm_msgs.msg import Answer
    from PIL import Image
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import CompressedImage

    values = params_with(tmp_path / "p.yaml", **{"queue_size": 8})
    assert values["explain"] == "subscribed" and values["serving.max_batch"] == 4       # shipped
    domain = domain_id(19)
    node = Proc(["drive", "--params", str(tmp_path / "p.yaml")], ros_env(domain), tmp_path / "node.log")
    client = RosClient(domain)
    reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    answers, pictures, diagnostics = [], [], []
    try:
        rig = Rig(client)
        client.node.create_subscription(Answer, "/litevlm/answer", lambda m: answers.append((time.monotonic(), m)),
                                        reliable)
        client.node.create_subscription(DiagnosticArray, "/diagnostics", diagnostics.append, 10)
        node.wait_for("ready (active)", timeout=180)
        assert client.spin_until(rig.connected, 30)
        client.spin_for(0.5)
        # Nobody subscribes to ~/explanation: answered, not explained.
        rig.frames(seed=5)
        client.spin_for(0.3)
        rig.ask("n0", QUESTIONS[0])
        assert client.spin_until(lambda: len(answers) == 1, 120), node.text()[-2000:]
        # A subscriber: three queries at once, one picture each.
        sub = client.node.create_subscription(CompressedImage, EXPLANATION_TOPIC,
                                              lambda m: pictures.append((time.monotonic(), m)), reliable)
        assert client.spin_until(lambda: sub.get_publisher_count() > 0, 30)
        client.spin_for(1.0)                                   # (the node's side of the match)
        rig.frames(seed=6)
        client.spin_for(0.3)
        for i, question in enumerate(QUESTIONS):
            rig.ask(f"e{i}", question)
        assert client.spin_until(lambda: len(answers) == 4 and len(pictures) == 3, 300), node.text()[-3000:]
        # explain: never, live (as `ros2 param set` sends it): answered, not explained, though someone subscribes.
        assert client.param_set("/litevlm_drive", "explain", "never").successful
        rig.frames(seed=7)
        client.spin_for(0.3)
        rig.ask("f0", QUESTIONS[1])
        assert client.spin_until(lambda: len(answers) == 5, 120), node.text()[-2000:]
        client.spin_for(5.0)
        diagnostics.clear()
        assert client.spin_until(lambda: diagnostics, 10)
    finally:
        client.close()
        node.stop()

    got = {m.query_id: (t, m) for t, m in answers}
    assert sorted(got) == ["e0", "e1", "e2", "f0", "n0"] and all(m.status == 0 for _, m in got.values())
    assert sorted(p.header.frame_id for _, p in pictures) == ["e0", "e1", "e2"]     # one per query, only these
    assert sum(got[f"e{i}"][1].batched_steps > 0 for i in range(3)) >= 2            # decoded in one batch
    for t, picture in pictures:
        answered_at, answer = got[picture.header.frame_id]
        assert picture.header.stamp == answer.header.stamp and picture.format == "jpeg"
        assert t >= answered_at                                         # published after its answer
        image = Image.open(io.BytesIO(bytes(picture.data)))
        assert image.format == "JPEG" and image.size[0] == 1440 and image.size[1] > 600
    # The Answer's objects as data: the question's tags, the malformed one named.
    e0, e2 = got["e0"][1], got["e2"][1]
    assert [(o.object_id, o.camera, o.x, o.y) for o in e0.question_objects] == [("c1", "CAM_FRONT", 800.0, 500.0)]
    assert [o.object_id for o in e2.question_objects] == ["c2"]
    assert len(e2.malformed_tags) == 1 and e2.malformed_tags[0].startswith("question '<c3,CAM_BAK,1,2>'")
    values = _diagnostic_values(diagnostics)
    assert values["explain"] == "never" and values["explanations.explained"] == "3", values
    assert float(values["explanation_ms.attention.p50"]) > 0 and float(values["explanation_ms.draw.p50"]) > 0
