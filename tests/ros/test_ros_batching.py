"""In-flight batching over DDS: the shipped parameters (serving.max_batch 4) on the bundled model,
queries arriving together and while others decode; every one is answered ok, several were
decoded in one batch, and each greedy answer equals the same query answered one at a time by the
pipeline in this process, from the same parameters and frames."""

from __future__ import annotations

from helpers.ros import Proc, Rig, RosClient, domain_id, jpeg, ros_env
from test_ros_partials import params_with

QUESTIONS = ["What is in front of the ego vehicle?", "Is there a pedestrian behind the ego car?",
             "What should the ego vehicle do next?", "Are there cars on the front left?",
             "What is the status of the truck?", "Describe the traffic behind the ego car."]


def test_batched_answers_over_dds_equal_one_at_a_time(tmp_path):
    import json

    from litevlm_msgs.msg import Answer
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    from litevlm_runtime.bundled import DEFAULT_MODEL
    from litevlm_runtime.cameras import CAMERAS
    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.ros.parameters import pipeline_options_from

    values = params_with(tmp_path / "p.yaml", **{"queue_size": 8})
    assert values["serving.max_batch"] == 4                       # shipped
    domain = domain_id(22)
    node = Proc(["drive", "--params", str(tmp_path / "p.yaml")], ros_env(domain), tmp_path / "node.log")
    client = RosClient(domain)
    try:
        rig = Rig(client)
        answers, mirrored = [], []
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        client.node.create_subscription(Answer, "/litevlm/answer", answers.append, reliable)
        client.node.create_subscription(String, "/litevlm/answer_json", lambda m: mirrored.append(json.loads(m.data)),
                                        reliable)
        node.wait_for("ready (active)", timeout=180)
        assert client.spin_until(rig.connected, 30)
        client.spin_for(0.5)
        rig.frames(seed=5)
        client.spin_for(0.3)
        for i, q in enumerate(QUESTIONS[:4]):                      # four at once
            rig.ask(f"b{i}", q)
        assert client.spin_until(lambda: answers, 120), node.text()[-2000:]
        rig.frames(seed=5)                                         # the same images, fresh (max_frame_age_s)
        client.spin_for(0.1)
        for i, q in enumerate(QUESTIONS[4:], start=4):             # two more while the first decode
            rig.ask(f"b{i}", q)
        assert client.spin_until(lambda: len(answers) == len(QUESTIONS) and len(mirrored) == len(QUESTIONS), 180), \
            node.text()[-2000:]
        # Constrained answers through the Query message: choices, and a schema that is not one.
        rig.frames(seed=5)
        client.spin_for(0.1)
        for qid, extra in (("c0", {"choices": ["Yes.", "No."]}), ("c1", {"answer_schema": "{not json"})):
            rig.ask(qid, "Is there a pedestrian in front of the ego car?", **extra)
        assert client.spin_until(lambda: len(answers) == len(QUESTIONS) + 2, 120), node.text()[-2000:]
        client.spin_for(0.5)
    finally:
        client.close()
        node.stop()

    got = {a.query_id: a for a in answers}
    assert got["c0"].status == 0 and got["c0"].answer in ("Yes.", "No."), got["c0"]
    assert got["c1"].status == 5 and "answer_schema" in got["c1"].status_message      # STATUS_BAD_QUESTION
    got = {k: a for k, a in got.items() if k.startswith("b")}
    assert sorted(got) == [f"b{i}" for i in range(len(QUESTIONS))] and len(answers) == len(QUESTIONS) + 2
    assert all(a.status == 0 for a in got.values()), [(a.query_id, a.status_message) for a in answers]
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, pipeline_options_from(values))
    images = {cam: jpeg(5 * 10 + i) for i, cam in enumerate(CAMERAS)}          # what rig.frames(seed=5) sent
    for i, q in enumerate(QUESTIONS):
        alone = pipe.answer(images, q)
        assert list(got[f"b{i}"].token_ids) == list(alone.token_ids), q
    # Several queries were decoded together (the JSON mirror says how many steps each shared).
    assert sum(1 for m in mirrored if m["batched_steps"] > 0) >= 2, [
        (m["query_id"], m["batched_steps"]) for m in mirrored
    ]
