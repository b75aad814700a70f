"""The ROS 2 node over real DDS on loopback: node, replayer and recorder run as separate
processes (`litevlm drive`, `litevlm bag replay`, `litevlm bag record`), each test on its own
ROS_DOMAIN_ID, with the project's Fast DDS profile. Answers are checked against `litevlm bag
eval` on the same bag (the same query server and pipeline without DDS)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.ros import PROFILE, Proc, domain_id, jpeg, ros_env, run_replay, write_params

from litevlm_runtime.bag.compare import compare_runs
from litevlm_runtime.bag.evaluate import evaluate
from litevlm_runtime.bag.ids import split
from litevlm_runtime.bag.io import BagContents, CameraFrame, camera_topic, raw_frame, write_bag
from litevlm_runtime.bag.make import drivelm_contents
from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.pipeline.answer import STAGES
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.ros.params_file import load_node_params

ROOT = Path(__file__).resolve().parents[2]
S = 1_000_000_000
T0 = 1_700_000_000 * S


@pytest.fixture(scope="module")
def params_for(tiny_model, tmp_path_factory):
    def make(**over):
        values = dict(model_dir=str(tiny_model), max_new_tokens=4, queue_size=8, max_frame_age_s=1.0, max_skew_s=0.1)
        values.update(over)
        return write_params(tmp_path_factory.mktemp("params") / "drive.yaml", **values)
    return make


def test_replay_of_drivelm_bag_matches_eval(tmp_path, drivelm_dir, params_for):
    bag = write_bag(drivelm_contents(drivelm_dir, max_frames=2, questions_per_frame=2, max_width=320), tmp_path / "bag")
    params = params_for()
    rows, node_log = run_replay(tmp_path, bag, params, n_answers=4, domain=domain_id(1))

    ids = [r["query_id"] for r in rows]
    assert sorted(ids) == ["f0q0", "f0q1", "f1q0", "f1q1"], ids            # every query, exactly once
    assert all(r["status"] == "ok" for r in rows), [r["status_message"] for r in rows]
    for r in rows:
        assert list(r["stage_ms"]) == list(STAGES) and all(v > 0 for v in r["stage_ms"].values()), r["stage_ms"]
        assert r["e2e_ms"] >= r["total_ms"] > 0
        assert r["answer"] and r["token_ids"]
    drivelm_questions = {qa["Q"] for scene in json.loads((drivelm_dir / "qa_scene_n008.json").read_text()).values()
                         for kf in scene["key_frames"].values() for qas in kf["QA"].values() for qa in qas}
    assert all(r["question"] in drivelm_questions for r in rows)          # real DriveLM questions

    # The recorded answer bag holds the same answers (rclpy CDR read back by rosbags).
    from litevlm_runtime.bag.io import read_bag
    bagged = [reader.deserialize(raw, mt) for _, _, mt, raw, reader in read_bag(tmp_path / "answers_bag")]
    assert sorted((split(m.query_id)[0], m.answer, list(m.token_ids)) for m in bagged) == \
        sorted((r["query_id"], r["answer"], r["token_ids"]) for r in rows)

    evaluated = evaluate(bag, load_node_params(params))
    cmp = compare_runs([e.to_json() for e in evaluated], rows)
    assert cmp.matched == 4 and cmp.ok, cmp.differences
    # Frames matched to each query are the same ones (offsets to the query stamp survive re-stamping).
    by_id = {r["query_id"]: r for r in rows}
    for e in evaluated:
        for cam, off in e.to_json()["frame_offsets_ms"].items():
            assert by_id[e.query_id]["frame_offsets_ms"][cam] == pytest.approx(off, abs=1e-3)

    # The CLI compare agrees and exits non-zero when an answer differs.
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(e.to_json()) + "\n" for e in evaluated))
    b.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok = subprocess.run([sys.executable, "-m", "litevlm_runtime.cli", "bag", "compare", str(a), str(b)],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "answers identical" in ok.stdout, ok.stdout + ok.stderr
    rows[0]["answer"] += " (changed)"
    b.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = subprocess.run([sys.executable, "-m", "litevlm_runtime.cli", "bag", "compare", str(a), str(b)],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 1 and "answer differs" in bad.stdout


RAW_CAMERAS = {"CAM_BACK_LEFT": "bgr8", "CAM_BACK_RIGHT": "mono8"}


def fault_bag(path: Path) -> tuple[Path, dict]:
    """Generated frames (no shared data needed; two cameras as raw sensor_msgs/Image) with one bad
    situation after another, and the status each query must get. Frame sets every ~1.5 s; max_frame_age 1 s,
    max_skew 0.1 s."""
    c = BagContents()

    def frame_set(t_s, skip=(), shift=None, corrupt=()):
        for i, cam in enumerate(CAMERAS):
            if cam in skip:
                continue
            t = T0 + int((t_s + 0.008 * i + (shift or {}).get(cam, 0.0)) * S)
            data = b"not an image at all" if cam in corrupt else jpeg(int(t_s * 10) * 10 + i)
            if cam in RAW_CAMERAS and cam not in corrupt:          # these two send sensor_msgs/Image
                c.frames[cam].append(raw_frame(t, data, RAW_CAMERAS[cam]))
            else:
                c.frames[cam].append(CameraFrame(t, data))

    expect = {}

    def ask(t_s, qid, text, status, deadline_s=None):
        c.queries.append(
            QueryRequest(
                text,
                stamp_ns=T0 + int(t_s * S),
                query_id=qid,
                deadline_ns=T0 + int(deadline_s * S) if deadline_s is not None else 0,
            )
        )
        expect[qid] = status

    # The node waits 0.2 s for frames. The first frames are stamped 0.5 s and the deadline is 0.45 s,
    # so however late a loaded machine handles this query (DDS orders nothing across topics), it
    # can never be served: no_frames when handled in time, deadline_passed when later.
    ask(0.00, "no_frames", "Anything in front?", "no_frames|deadline_passed", deadline_s=0.45)
    frame_set(0.50)
    ask(0.70, "ok_first", "What is in front of the ego car?", "ok")
    ask(0.75, "empty", "   ", "bad_question")
    ask(0.80, "oversized", "why " * 1000, "bad_question")
    ask(0.85, "late", "Is it too late?", "deadline_passed", deadline_s=0.80)
    frame_set(2.00, skip=("CAM_BACK",))                                  # CAM_BACK stops publishing
    ask(2.20, "camera_stopped", "What is behind?", "stale_frames")
    frame_set(3.50, shift={"CAM_FRONT_LEFT": 0.30})                      # back, but one camera 300 ms off
    ask(3.90, "out_of_sync", "What is to the front left?", "out_of_sync")
    frame_set(5.00, corrupt=("CAM_FRONT",))
    ask(5.20, "undecodable", "What is in front?", "bad_image")
    frame_set(6.50)                                                       # all good again
    ask(6.70, "ok_again", "What is behind the ego car?", "ok")
    for i in range(6):                                                    # a burst into a queue of 1
        ask(6.80, f"burst{i}", f"Burst question {i}?", "ok|queue_full")
    return write_bag(c, path), expect


def test_bad_inputs_get_error_answers_and_serving_resumes(tmp_path, params_for):
    bag, expect = fault_bag(tmp_path / "faults")
    topics = [camera_topic(c, c in RAW_CAMERAS) for c in CAMERAS]
    params = params_for(queue_size=1, max_question_chars=2000, camera_topics=topics)
    rows, node_log = run_replay(tmp_path, bag, params, n_answers=len(expect), domain=domain_id(2))

    got = {}
    for r in rows:
        assert r["query_id"] not in got, f"{r['query_id']} answered twice"
        got[r["query_id"]] = r
    assert set(got) == set(expect)
    for qid, status in expect.items():
        assert got[qid]["status"] in status.split("|"), (qid, got[qid]["status"], got[qid]["status_message"])
        if got[qid]["status"] != "ok":
            assert got[qid]["status_message"] and not got[qid]["answer"]
    assert "CAM_BACK" in got["camera_stopped"]["status_message"]
    assert "CAM_FRONT" in got["undecodable"]["status_message"]
    burst = [got[f"burst{i}"]["status"] for i in range(6)]
    assert "queue_full" in burst and "ok" in burst, burst
    assert got["ok_again"]["status"] == "ok"

    # bag eval gives the same status for every query outside the burst (it has no queue to fill).
    evaluated = {e.query_id: e for e in evaluate(bag, load_node_params(params))}
    for qid, r in got.items():
        if not qid.startswith("burst"):
            assert evaluated[qid].status == r["status"] or {evaluated[qid].status, r["status"]} <= set(
                expect[qid].split("|")), qid
            assert evaluated[qid].token_ids == r["token_ids"], qid


def test_model_that_fails_to_load_answers_every_question_with_an_error(tmp_path, params_for, monkeypatch):
    """String questions, the JSON mirror and /diagnostics, seen by a client in this process."""
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"llm_config": {}, "vision_config": {}}))
    domain = domain_id(3)
    node = Proc(["drive", "--params", str(params_for(model_dir=str(broken)))], ros_env(domain), tmp_path / "node.log")
    monkeypatch.setenv("FASTDDS_DEFAULT_PROFILES_FILE", str(PROFILE))
    ctx = rclpy.Context()
    rclpy.init(context=ctx, domain_id=domain)
    client = rclpy.create_node("test_client", context=ctx)
    try:
        node.wait_for("ready (", timeout=120)
        assert "configure failed" in node.text()
        qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        answers, diags = [], []
        client.create_subscription(String, "/litevlm/answer_json", lambda m: answers.append(json.loads(m.data)), qos)
        client.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
        pub = client.create_publisher(String, "/litevlm/question", qos)
        executor = rclpy.executors.SingleThreadedExecutor(context=ctx)
        executor.add_node(client)

        def spin_until(cond, timeout):
            end = time.time() + timeout
            while not cond() and time.time() < end:
                executor.spin_once(timeout_sec=0.1)
            return cond()

        assert spin_until(lambda: pub.get_subscription_count() > 0, 30)
        time.sleep(0.5)
        for text in ("Is the road clear?", "What is behind?"):
            pub.publish(String(data=text))
        assert spin_until(lambda: len(answers) >= 2 and diags, 30), (answers, node.text()[-2000:])
        spin_until(lambda: False, 0.5)                                   # nothing more may arrive
        assert [a["question"] for a in answers] == ["Is the road clear?", "What is behind?"]
        assert all(a["status"] == "pipeline_error" and "model not loaded" in a["status_message"] for a in answers)
        assert "config.json" in answers[0]["status_message"]
        st = diags[-1].status[0]
        assert st.level == DiagnosticStatus.ERROR and "model not loaded" in st.message
        values = {kv.key: kv.value for kv in st.values}
        assert values["model"] == str(broken) and values["backend"] == "torch"
        assert {"queue_depth", "dropped_frames", "errors", "last_error"} <= set(values)
    finally:
        client.destroy_node()
        rclpy.shutdown(context=ctx)
        node.stop()
