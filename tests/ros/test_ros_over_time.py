"""Frame sets over time through the ROS 2 node over real DDS (separate processes: `litevlm drive`,
`litevlm bag replay`, `litevlm bag record`, each test on its own ROS_DOMAIN_ID):

- a bag of SynthDrive sequences (`synth --frames 4`, `bag make --query-frames 4`), replayed twice
  in a row into one running node, is answered as `bag eval` answers it, both times: the same
  tokens, the same four frame sets (offsets from the query's stamp), the same kept tokens per set;
- standing questions over a replay with a frozen stretch: each answered once per changed frame set
  on ~/standing/NAME, never while the cameras repeat themselves, while every asked query gets
  exactly one answer on the answer topic."""

from __future__ import annotations

import time

import pytest
from helpers.ros import (
    Proc,
    RosClient,
    domain_id,
    jpeg,
    record_topic,
    replayed_as_evaluated,
    ros_env,
    sequence_bag,
    write_params,
)

from litevlm_runtime.bag.compare import read_jsonl
from litevlm_runtime.bag.evaluate import evaluate
from litevlm_runtime.bag.io import BagContents, CameraFrame, write_bag
from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.ros.params_file import load_node_params

S = 1_000_000_000
T0 = 1_700_000_000 * S
K = 4


@pytest.fixture(scope="module")
def motion_bag(tmp_path_factory):
    """3 scenes of SynthDrive in motion, 4 frame sets 0.5 s apart each, every question over 4 sets."""
    return sequence_bag(tmp_path_factory.mktemp("motion"), frames=K)


def rows_of(out) -> list[dict]:
    return read_jsonl(out) if out.exists() else []


def test_a_bag_of_sequences_replayed_twice_into_the_node_answers_as_bag_eval(tmp_path, tiny_model, motion_bag):
    params = write_params(tmp_path / "drive.yaml", model_dir=str(tiny_model), max_new_tokens=6, queue_size=16,
                          warmup=False, **{"decoding.mode": "greedy"})
    evaluated = [e.to_json() for e in evaluate(motion_bag, load_node_params(params))]
    assert len(evaluated) == 6 and all(e["status"] == "ok" for e in evaluated), [e["status_message"] for e in evaluated]
    assert all(e["frames"] == K and len(e["frame_set_offsets_ms"]) == K for e in evaluated)
    for e in evaluated:      # the key set just before the question, the others 0.5 s apart before it
        offsets = e["frame_set_offsets_ms"]
        assert [round(b - a, 3) for a, b in zip(offsets, offsets[1:])] == [500.0] * (K - 1), offsets

    env = ros_env(domain_id(34))
    node = Proc(["drive", "--params", str(params)], env, tmp_path / "node.log")
    try:
        node.wait_for("ready (active)", timeout=180)
        for label in ("first", "second"):                 # the same running node, twice in a row
            rows = replayed_as_evaluated(tmp_path, env, motion_bag, params, evaluated, label, node.text)
            by_id = {r["query_id"]: r for r in rows}
            for e in evaluated:                          # (compare_runs checks these too; said here plainly)
                r = by_id[e["query_id"]]
                assert r["frames"] == K and r["kept_per_frame"] == e["kept_per_frame"]
                assert r["frame_set_offsets_ms"] == pytest.approx(e["frame_set_offsets_ms"], abs=1e-3)
    finally:
        node.stop()


def frozen_bag(path) -> tuple[object, list[int]]:
    """Ten frame sets 0.5 s apart: sets 0-2 each a new scene, sets 3-6 the cameras sending set 2's
    images again (a frozen stretch), sets 7-9 new again; two questions asked among them."""
    c = BagContents()
    shown = [0, 1, 2, 2, 2, 2, 2, 7, 8, 9]
    for k, scene in enumerate(shown):
        t = T0 + k * S // 2
        for i, cam in enumerate(CAMERAS):
            c.frames[cam].append(CameraFrame(t, jpeg(100 * scene + i, (160, 90))))
    for qid, k in (("asked_live", 1), ("asked_frozen", 4), ("asked_again", 8)):
        c.queries.append(QueryRequest("What is in front of the ego car?", query_id=qid,
                                      stamp_ns=T0 + k * S // 2 + S // 5))
    return write_bag(c, path), shown


def test_standing_questions_over_dds_answered_once_per_changed_set_not_while_frozen(tmp_path, tiny_model):
    bag, shown = frozen_bag(tmp_path / "frozen")
    params = write_params(tmp_path / "drive.yaml", model_dir=str(tiny_model), max_new_tokens=6, queue_size=16,
                          warmup=False, standing_questions=["ahead: Is the road ahead clear?",
                                                            "behind: What is behind the ego vehicle?"],
                          standing_rate_hz=2.0, standing_frames=1, **{"decoding.mode": "greedy"})
    changed = [k for k in range(len(shown)) if k == 0 or shown[k] != shown[k - 1]]      # sets 0, 1, 2, 7, 8, 9
    from diagnostic_msgs.msg import DiagnosticArray

    domain = domain_id(35)
    env = ros_env(domain)
    node = Proc(["drive", "--params", str(params)], env, tmp_path / "node.log")
    procs = [node]
    client = RosClient(domain)
    diags = []
    client.node.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
    try:
        node.wait_for("ready (active)", timeout=180)
        answers, out_answers = record_topic(tmp_path, env, "answers", "/litevlm/answer", 3)
        standing = {name: record_topic(tmp_path, env, name, f"/litevlm_drive/standing/{name}")
                    for name in ("ahead", "behind")}
        procs += [answers, *(p for p, _ in standing.values())]
        replayer = Proc(["bag", "replay", str(bag), "--params", str(params)], env, tmp_path / "replay.log")
        procs.append(replayer)
        assert replayer.wait(240) == 0, replayer.text()
        assert answers.wait(240) == 0, answers.text() + node.text()[-3000:]
        end = time.monotonic() + 120        # every changed set answered by now (or soon) ...
        while time.monotonic() < end and any(len(rows_of(out)) < len(changed) for _, out in standing.values()):
            client.spin_for(0.2)
        client.spin_for(3.0)                 # ... and nothing more comes: the bag ended 3 s ago
        for proc, _ in standing.values():
            proc.stop()
        diag = {kv.key: kv.value for kv in diags[-1].status[0].values}
        node.stop()
        rows = read_jsonl(out_answers)
        assert sorted(r["query_id"] for r in rows) == ["asked_again", "asked_frozen", "asked_live"]   # one each
        assert all(r["status"] == "ok" for r in rows), [r["status_message"] for r in rows]
        for name, (_, out) in standing.items():
            got = rows_of(out)
            assert all(r["status"] == "ok" and r["question"] for r in got), [r["status_message"] for r in got]
            first = got[0]["query_stamp_ns"]            # the replay re-stamps: sets by their distance in time
            sets = [round((r["query_stamp_ns"] - first) / (S // 2)) for r in got]
            assert sets == [k - changed[0] for k in changed], (name, sets)
            for r in got:                               # stamped with the frames it used (the set's newest)
                assert set(r["frame_offsets_ms"].values()) == {0.0} and r["frame_set_offsets_ms"] == [0.0]
            # /diagnostics counts them: the changed sets answered, the frozen ones found unchanged
            assert (diag[f"standing.{name}.answered"], diag[f"standing.{name}.unchanged"]) == (str(len(changed)), "4")
            assert diag[f"standing.{name}.question"] == {"ahead": "Is the road ahead clear?",
                                                         "behind": "What is behind the ego vehicle?"}[name]
        assert (diag["standing_rate_hz"], diag["standing_questions"]) == ("2", "2")
        assert diag["following_frame_sets"] == "True"
        assert (diag["temporal.frames"], diag["temporal.max_frames"], diag["temporal.stride_s"]) == ("1", "4", "0.5")
        assert int(diag["views_reused"]) > 0        # the asked queries found the sets the worker prefetched
    finally:
        for p in reversed(procs):
            p.stop()
        client.close()
