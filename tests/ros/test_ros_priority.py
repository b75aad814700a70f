"""Query.priority end to end over real DDS: a burst of low-priority questions fills a node's
batch (serving.max_batch 2) and queue; a high-priority question published after them is answered
before the burst's queued ones (it preempts a running one at the next pass), and every answer,
the preempted one's too, is the one the pipeline gives that question alone."""

from __future__ import annotations

from helpers.ros import Proc, Rig, RosClient, domain_id, jpeg, ros_env, write_params

LOW = ["What is in front of the ego car?", "Is there a truck behind?", "What should the ego vehicle do?",
       "Are there pedestrians on the left?", "Describe the scene.", "Is the road wet?", "Is it raining?",
       "What is the ego vehicle doing?", "Any cyclists around?", "Is the light green?"]
HIGH = "Is there a pedestrian in front of the ego car?"


def test_a_high_priority_query_overtakes_a_burst(tmp_path, tiny_model):

    from litevlm_runtime.cameras import CAMERAS
    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.ros.parameters import pipeline_options_from
    from litevlm_runtime.ros.params_file import load_node_params

    params = write_params(tmp_path / "p.yaml", model_dir=str(tiny_model), warmup=False, max_new_tokens=64,
                         queue_size=16, max_frame_age_s=10.0, **{"serving.max_batch": 2, "decoding.mode": "greedy"})
    domain = domain_id(36)
    node = Proc(["drive", "--params", str(params)], ros_env(domain), tmp_path / "node.log")
    client = RosClient(domain)
    try:
        rig = Rig(client)
        node.wait_for("ready (active)", timeout=180)
        assert client.spin_until(rig.connected, 30)
        client.spin_for(0.5)
        rig.frames(seed=7)
        client.spin_for(0.3)

        for i, q in enumerate(LOW):
            rig.ask(f"low{i}", q, priority=0)
        client.spin_for(0.05)
        rig.frames(seed=7)          # a later frame set: the questions' own set is complete (frame_match as_asked)
        # The high-priority question goes out once the burst's first answer is back, whatever this
        # machine's speed: then two lows run and the rest wait in the queue.
        assert client.spin_until(lambda: len(rig.answers) >= 1, 120), node.text()[-3000:]
        answered_before = len(rig.answers)
        rig.ask("high", HIGH, priority=200)
        client.spin_for(0.05)
        rig.frames(seed=7)
        assert client.spin_until(lambda: len(rig.answers) == len(LOW) + 1, 240), node.text()[-3000:]
    finally:
        client.close()
        node.stop()
    order = [a.query_id for a in rig.answers]
    assert all(a.status == 0 for a in rig.answers), [(a.query_id, a.status_message) for a in rig.answers]
    # Ahead of it: the answers back before it was sent, the one decoding beside it (the other is
    # preempted), and one more that may end while it is in flight; without priorities it would be
    # last (queued behind all the rest).
    assert answered_before + 2 < len(LOW), order
    assert order.index("high") <= answered_before + 2, (answered_before, order)
    pipe = Pipeline.from_pretrained(tiny_model, pipeline_options_from(load_node_params(params)))
    images = {cam: jpeg(7 * 10 + i) for i, cam in enumerate(CAMERAS)}
    for a in rig.answers:
        q = HIGH if a.query_id == "high" else LOW[int(a.query_id[3:])]
        assert list(a.token_ids) == pipe.answer(images, q).token_ids, a.query_id
