"""The bag tools as a user drives them, over real DDS: a raw-image bag replayed into a node with
the shipped camera topics is answered as `bag eval` answers it; the same bag replayed again and
again beside busy processes gets the same answers; Ctrl-C of `bag record` and `bag replay` ends
with their summary line and no traceback; `bag record` of a topic of another type is refused
naming it."""

from __future__ import annotations

import signal
import subprocess
import sys

from helpers.ros import Proc, RosClient, domain_id, ros_env, write_params
from test_bag_as_it_comes import contents

from litevlm_runtime.bag.compare import compare_runs, read_jsonl
from litevlm_runtime.bag.evaluate import evaluate
from litevlm_runtime.bag.io import write_bag
from litevlm_runtime.ros.params_file import load_node_params


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


def test_a_raw_bag_replayed_twice_into_a_default_node_beside_busy_processes(tmp_path, tiny_model):
    """The node listens on the shipped .../image_raw/compressed topics; the bag has raw
    .../image_raw. Two replays beside two busy processes: each replay's answers equal `bag
    eval`'s of the bag, query by query (so the two replays' equal each other's)."""
    bag = write_bag(contents(raw="bgr8", n_sets=2), tmp_path / "raw_bag")
    settings = dict(model_dir=str(tiny_model), warmup=False, max_new_tokens=2, queue_size=8, require_manifest=False,
                    match_wait_s=1.0)   # (frames published 0.2 s before a question have 1.2 s to come in)
    params = write_params(tmp_path / "p.yaml", **settings)
    evaluated = [r.to_json() for r in evaluate(bag, load_node_params(params))]
    assert [(r["query_id"], r["status"]) for r in evaluated] == [("q0", "ok"), ("q1", "ok")]
    env = ros_env(domain_id(15))
    out = tmp_path / "recorded.jsonl"
    node = Proc(["drive", "--params", str(params)], env, tmp_path / "node.log")
    recorder = Proc(["bag", "record", "--out", str(out), "--count", "4", "--timeout", "900"], env,
                    tmp_path / "record.log")
    procs, hogs = [node, recorder], busy_processes(2)
    try:
        node.wait_for("ready (active)", timeout=180)
        recorder.wait_for("record: ready", timeout=60)
        for k in range(2):
            replayer = Proc(["bag", "replay", str(bag), "--params", str(params)], env, tmp_path / f"replay{k}.log")
            procs.append(replayer)
            assert replayer.wait(300) == 0, replayer.text()
        assert recorder.wait(900) == 0, recorder.text() + node.text()[-3000:]
    finally:
        for h in hogs:
            h.kill()
        for p in procs:
            p.stop()
    rows = read_jsonl(out)
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), \
        ([r["status_message"] for r in rows], node.text()[-3000:], recorder.text()[-2000:])
    for replay in sorted({r["replay"] for r in rows}):
        mine = [r for r in rows if r["replay"] == replay]
        result = compare_runs(evaluated, mine)
        assert result.ok and result.matched == 2, (replay, result)
    assert "/cam_front/image_raw" in node.text()        # /diagnostics and the log name the raw topic


def test_ctrl_c_of_record_and_replay_ends_with_the_summary(tmp_path):
    env = ros_env(domain_id(16))
    out = tmp_path / "a.jsonl"
    record = Proc(["bag", "record", "--out", str(out)], env, tmp_path / "record.log")
    c = contents(n_sets=30)              # 30 s of frames: interrupted long before its end
    replay = Proc(["bag", "replay", str(write_bag(c, tmp_path / "long")), "--wait", "0"], env,
                  tmp_path / "replay.log")
    try:
        replay.wait_for("query published", timeout=60)
        for p in (record, replay):
            p.p.send_signal(signal.SIGINT)
        assert record.wait(30) == 0 and replay.wait(30) == 130
    finally:
        record.stop(), replay.stop()
    assert "record: 0 answers -> " in record.text() and "(interrupted)" in record.text(), record.text()
    assert "replay: interrupted, " in replay.text(), replay.text()
    for p in (record, replay):
        assert "Traceback" not in p.text() and "RCLError" not in p.text(), p.text()


def test_record_refuses_a_topic_of_another_type(tmp_path):
    from std_msgs.msg import String

    domain = domain_id(17)
    client = RosClient(domain)
    pub = client.node.create_publisher(String, "/litevlm/answer_json", 10)
    record = Proc(["bag", "record", "--out", str(tmp_path / "a.jsonl"), "--topic", "/litevlm/answer_json",
                   "--timeout", "60"], ros_env(domain), tmp_path / "record.log")
    try:
        assert client.spin_until(lambda: not record.alive(), 60), record.text()
        assert pub.get_subscription_count() >= 0
    finally:
        client.close()
        record.stop()
    text = record.text()
    assert record.p.returncode == 2, text
    assert "--topic /litevlm/answer_json carries std_msgs/msg/String, not litevlm_msgs/msg/Answer" in text, text
    assert "Traceback" not in text
