"""Streamed partial answers over DDS (litevlm_msgs/AnswerPartial on litevlm/answer_partial): the
shipped parameters on the bundled model, with EAGLE-2 speculating every round (a fixed tree, so
that partials come per accepted round, not per greedy step); the partials of one query grow and
end with a final one whose text is the Answer's, which is also the answer the pipeline gives
unstreamed (in this process, no partials). The node publishes the final partial before the
Answer, but DDS orders messages per topic only, so the test does not rely on the order across
the two topics."""

from __future__ import annotations

import yaml
from helpers.ros import ROOT, Proc, Rig, RosClient, domain_id, jpeg, ros_env, write_params

QUESTION = ("What actions could the ego vehicle take based on <c1,CAM_FRONT,800.0,500.0>? Why take this action and "
            "what's the probability?")


def params_with(path, **overrides):
    """config/drive.yaml with some parameters changed (dotted names), as a user's own copy."""
    from litevlm_runtime.ros.parameters import flatten, node_section

    doc = yaml.safe_load((ROOT / "config" / "drive.yaml").read_text())
    values = flatten(node_section(doc, "litevlm_drive")) | overrides
    write_params(path, **values)
    return values


def test_partials_then_the_final_answer_equal_to_the_unstreamed_one(tmp_path):
    from litevlm_msgs.msg import Answer, AnswerPartial
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from litevlm_runtime.bundled import DEFAULT_MODEL
    from litevlm_runtime.cameras import CAMERAS
    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.ros.parameters import pipeline_options_from

    values = params_with(tmp_path / "p.yaml", **{"decoding.eagle.policy": "fixed"})
    assert values["serving.stream_partials"] is True and values["model_dir"] == ""     # shipped: on, bundled model
    domain = domain_id(32)
    node = Proc(["drive", "--params", str(tmp_path / "p.yaml")], ros_env(domain), tmp_path / "node.log")
    client = RosClient(domain)
    try:
        rig = Rig(client)
        partials, answers = [], []
        reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        client.node.create_subscription(AnswerPartial, "/litevlm/answer_partial", partials.append, reliable)
        client.node.create_subscription(Answer, "/litevlm/answer", answers.append, reliable)
        node.wait_for("ready (active)", timeout=180)
        assert client.spin_until(lambda: rig.connected() and client.node.count_publishers(
            "/litevlm/answer_partial") > 0, 30)
        client.spin_for(0.5)
        rig.frames(seed=3)
        client.spin_for(0.3)
        rig.ask("p1", QUESTION)
        assert client.spin_until(lambda: answers and partials and partials[-1].final, 120), node.text()[-2000:]
        client.spin_for(0.5)                              # nothing may follow the final partial
        rig.frames(seed=3)                                # fresh frames (the first set may be stale by now)
        client.spin_for(0.3)
        rig.ask("p2", QUESTION, budget_ms=60_000.0)     # a Query's own budget reaches the pipeline
        assert client.spin_until(lambda: len(answers) == 2, 120), node.text()[-2000:]
        client.spin_for(0.5)
    finally:
        client.close()
        node.stop()

    assert [a.query_id for a in answers] == ["p1", "p2"] and answers[1].status == 0
    assert (answers[0].budget_ms, answers[1].budget_ms, answers[1].budget_met) == (0.0, 60_000.0, True)
    answer = answers[0]
    assert answer.status == 0, answer
    partials = [m for m in partials if m.query_id == "p1"]
    assert answer.pipeline.startswith("litevlm[") and "eagle" in answer.pipeline, answer.pipeline
    assert len(partials) >= 3 and all(m.query_id == "p1" for m in partials)
    assert [m.final for m in partials] == [False] * (len(partials) - 1) + [True]
    counts = [m.token_count for m in partials]
    assert counts[0] == 1 and counts == sorted(counts) and counts[-1] == len(answer.token_ids)
    assert partials[-1].text == answer.answer == partials[-2].text        # the last partials: the answer
    assert answer.decode_steps < counts[-1]                               # EAGLE-2 rounds of several tokens ...
    assert max(b - a for a, b in zip(counts, counts[1:])) > 1             # ... streamed a round at a time

    # The same query unstreamed, in this process, from the same parameters and frames.
    options = pipeline_options_from(values)
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options)
    images = {cam: jpeg(3 * 10 + i) for i, cam in enumerate(CAMERAS)}          # what rig.frames(seed=3) sent
    plain = pipe.answer(images, QUESTION)
    assert plain.text == answer.answer and list(plain.token_ids) == list(answer.token_ids)
