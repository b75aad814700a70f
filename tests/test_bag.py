"""Bag making, reading and comparing without DDS (rosbags only), and bag eval's determinism."""

import json

import pytest

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.ros.bag import (bag_topics, compare_runs, drivelm_contents, evaluate, latency_table,
                                     load_node_params, read_bag, write_bag)
from litevlm_runtime.ros.server import STATUS_CODES


def test_status_codes_are_the_message_constants():
    from litevlm_msgs.msg import Answer

    for name, code in STATUS_CODES.items():
        assert getattr(Answer, f"STATUS_{name.upper()}") == code


def test_drivelm_bag_has_real_timing_and_questions(tmp_path, drivelm_dir):
    bag = write_bag(drivelm_contents(drivelm_dir, questions_per_frame=2, max_width=160), tmp_path / "b", storage="sqlite3")
    topics = bag_topics(bag)
    assert topics["/litevlm/query"] == "litevlm_msgs/msg/Query"
    assert sum(1 for t in topics.values() if t == "sensor_msgs/msg/CompressedImage") == 6
    frames, queries = {c: [] for c in CAMERAS}, []
    for t, topic, msgtype, raw, reader in read_bag(bag):
        msg = reader.deserialize(raw, msgtype)
        stamp = msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec
        assert stamp == t                                        # log time = header stamp
        if msgtype.endswith("CompressedImage"):
            frames[topic.split("/")[1].upper()].append((t, bytes(msg.data[:3])))
        else:
            queries.append((t, msg.id, msg.text))
    assert all(len(v) == 9 for v in frames.values())
    assert all(d == b"\xff\xd8\xff" for v in frames.values() for _, d in v)
    # The n008 scene (with QA) comes first, at its real capture times (file names, microseconds).
    assert frames["CAM_FRONT"][0][0] == 1537291002262404 * 1000
    assert frames["CAM_BACK_LEFT"][1][0] - frames["CAM_FRONT"][1][0] == (1537291005197405 - 1537291005162404) * 1000
    qa = json.loads((drivelm_dir / "qa_scene_n008.json").read_text())
    real = {q["Q"] for s in qa.values() for kf in s["key_frames"].values() for qs in kf["QA"].values() for q in qs}
    assert len(queries) == 18 and all(text in real for _, _, text in queries[:8])
    assert queries[0][0] == max(v[0][0] for v in frames.values()) + 200_000_000


def test_rendered_frames_without_capture_times(tmp_path):
    """SynthDrive-style folder: DriveLM layout, no capture time in the names -> 2 Hz timeline."""
    from PIL import Image

    for cam in CAMERAS:
        (tmp_path / "samples" / cam).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (64, 36), (i * 40, 10, 10)).save(tmp_path / "samples" / cam / f"synth-{i:03d}__{cam}.jpg")
    contents = drivelm_contents(tmp_path, questions_per_frame=1)
    stamps = [f.stamp_ns for f in contents.frames["CAM_FRONT"]]
    assert [s - stamps[0] for s in stamps] == [0, 500_000_000, 1_000_000_000]
    assert len(contents.queries) == 3
    bag = write_bag(contents, tmp_path / "bag")
    with pytest.raises(InputError):
        write_bag(contents, tmp_path / "bag")                   # never overwrites
    assert len(list(read_bag(bag))) == 18 + 3


def test_incomplete_folder_is_refused(tmp_path):
    (tmp_path / "samples" / "CAM_FRONT").mkdir(parents=True)
    with pytest.raises(InputError, match="CAM_FRONT_LEFT"):
        drivelm_contents(tmp_path)


def test_eval_is_deterministic(tmp_path, drivelm_dir, tiny_model):
    bag = write_bag(drivelm_contents(drivelm_dir, max_frames=1, questions_per_frame=2, max_width=160), tmp_path / "b")
    params = load_node_params(None, {"model_dir": str(tiny_model), "max_new_tokens": "3", "warmup": "false"})
    a = [r.to_json() for r in evaluate(bag, params)]
    b = [r.to_json() for r in evaluate(bag, params)]
    cmp = compare_runs(a, b)
    assert cmp.ok and cmp.matched == 2 and [r["status"] for r in a] == ["ok", "ok"]
    assert {row[0] for row in cmp.latency_rows} >= {"prefill", "decode", "total"}


def test_compare_reports_every_kind_of_difference():
    def row(qid, **kw):
        base = {"query_id": qid, "status": "ok", "answer": "go", "token_ids": [1], "cameras": ["CAM_FRONT"],
                "stage_ms": {"prefill": 2.0}, "total_ms": 2.0, "queue_ms": 0.0}
        return base | kw
    a = [row("q1"), row("q2"), row("q3")]
    b = [row("q1", total_ms=3.0, stage_ms={"prefill": 3.0}), row("q2", answer="stop", token_ids=[2]), row("q4"), row("q4")]
    cmp = compare_runs(a, b)
    text = "\n".join(cmp.differences)
    assert not cmp.ok
    assert "q2: answer differs" in text and "q2: token_ids differs" in text
    assert "q3: only in A" in text and "q4: only in B" in text and "q4: answered 2 times in B" in text
    assert "q1" not in text                                      # latency alone is not a difference
    assert dict((r[0], r[2] - r[1]) for r in cmp.latency_rows)["prefill"] == pytest.approx(0.5)


def test_latency_table_splits_transport():
    rows = [{"status": "ok", "stage_ms": {"decode": 10.0}, "total_ms": 10.0, "queue_ms": 2.0, "e2e_ms": 15.0},
            {"status": "queue_full", "stage_ms": {}, "total_ms": 0.0, "queue_ms": 0.0, "e2e_ms": 1.0}]
    table = {name: (p50, n) for name, p50, _, n in latency_table(rows)}
    assert table["transport"] == (3.0, 1) and table["e2e"] == (15.0, 1)


def test_raw_image_bag_round_trip(tmp_path):
    """--raw: sensor_msgs/Image on .../image_raw, pixels as the node will convert them back."""
    from PIL import Image

    from litevlm_runtime.ros.images import RawPayload, to_pipeline_image

    for cam in CAMERAS:
        (tmp_path / "samples" / cam).mkdir(parents=True)
        Image.new("RGB", (40, 20), (200, 30, 10)).save(tmp_path / "samples" / cam / f"s-000__{cam}.png")
    bag = write_bag(drivelm_contents(tmp_path, raw_encoding="bgr8"), tmp_path / "bag")
    assert set(bag_topics(bag)) == {f"/{c.lower()}/image_raw" for c in CAMERAS} | {"/litevlm/query"}
    for _, topic, msgtype, raw, reader in read_bag(bag):
        if msgtype == "sensor_msgs/msg/Image":
            m = reader.deserialize(raw, msgtype)
            assert (m.encoding, m.width, m.height, m.step) == ("bgr8", 40, 20, 120)
            rgb = to_pipeline_image("CAM_FRONT", RawPayload(m.encoding, m.height, m.width, m.step, bytes(m.data)))
            assert rgb.shape == (20, 40, 3) and tuple(rgb[0, 0]) == (200, 30, 10)
