"""Bag making, reading and comparing without DDS (rosbags only), and bag eval's determinism."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest
from helpers.bag import jpeg_frames, mcap_ros2_bag, tiny_params
from PIL import Image

from litevlm_runtime.bag.compare import compare_runs, latency_table
from litevlm_runtime.bag.dds import replay_qos, select_topics
from litevlm_runtime.bag.evaluate import evaluate
from litevlm_runtime.bag.io import bag_files, bag_topic_info, bag_topics, camera_topic, read_bag, typestore, write_bag
from litevlm_runtime.bag.make import drivelm_contents
from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.ros.params_file import load_node_params
from litevlm_runtime.serving.images import RAW_ENCODINGS
from litevlm_runtime.serving.server import STATUS_CODES


def test_status_codes_are_the_message_constants():
    from litevlm_msgs.msg import Answer

    for name, code in STATUS_CODES.items():
        assert getattr(Answer, f"STATUS_{name.upper()}") == code


def test_drivelm_bag_has_real_timing_and_questions(tmp_path, drivelm_dir):
    bag = write_bag(
        drivelm_contents(drivelm_dir, questions_per_frame=2, max_width=160), tmp_path / "b", storage="sqlite3"
    )
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
    b = [
        row("q1", total_ms=3.0, stage_ms={"prefill": 3.0}),
        row("q2", answer="stop", token_ids=[2]),
        row("q4"),
        row("q4"),
    ]
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

    from litevlm_runtime.serving.images import RawPayload, to_pipeline_image

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


# ---------------------------------------------------------------------------------------------
# Bags as other tools write them: every raw encoding, image_transport format strings, extra
# topics (/tf, /imu), recorded QoS, bare storage files without metadata.yaml.
RAW_TOPICS = [camera_topic(c, raw=True) for c in CAMERAS]
LOSSLESS = ("rgb8", "bgr8", "rgba8", "bgra8", "rgb16", "bgr16", "rgba16", "bgra16")


def png_frames(folder, size=(64, 36), seed=0):
    """One six-camera frame set of random PNGs (lossless) in the DriveLM layout."""
    rng = np.random.default_rng(seed)
    for cam in CAMERAS:
        (folder / "samples" / cam).mkdir(parents=True)
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / "samples" / cam / f"s-000__{cam}.png")
    return folder


@pytest.fixture(scope="module")
def png_bag_answers(tmp_path_factory, tiny_model):
    """What the same frames, sent as lossless PNG CompressedImage, are answered."""
    folder = png_frames(tmp_path_factory.mktemp("png"))
    bag = write_bag(drivelm_contents(folder, questions_per_frame=1), folder / "bag")
    return folder, [r.token_ids for r in evaluate(bag, tiny_params(tiny_model))]


@pytest.mark.parametrize("encoding", list(RAW_ENCODINGS))
def test_every_raw_encoding_answers_ok_in_bag_eval(encoding, tmp_path, tiny_model, png_bag_answers):
    """rosbags sqlite3 bag of sensor_msgs/Image in `encoding`; default parameters but for the
    tiny model and the raw camera topics. Lossless encodings answer exactly as the PNG bag."""
    folder, png_tokens = png_bag_answers
    bag = write_bag(drivelm_contents(folder, questions_per_frame=1, raw_encoding=encoding), tmp_path / "bag",
                    storage="sqlite3")
    msgs = [reader.deserialize(raw, mt) for _, _, mt, raw, reader in read_bag(bag) if mt == "sensor_msgs/msg/Image"]
    assert len(msgs) == 6 and {m.encoding for m in msgs} == {encoding}
    records = evaluate(bag, tiny_params(tiny_model, camera_topics=RAW_TOPICS))
    assert [r.status for r in records] == ["ok"], [r.status_message for r in records]
    if encoding in LOSSLESS:
        assert [r.token_ids for r in records] == png_tokens


def test_raw_frame_names_the_file_that_cannot_be_encoded(tmp_path):
    png_frames(tmp_path, size=(63, 36))
    with pytest.raises(InputError, match=r"s-000__CAM_FRONT\.png: raw encoding yuv422: needs an even width"):
        drivelm_contents(tmp_path, raw_encoding="yuv422")
    with pytest.raises(InputError, match="raw encoding 'yuv420' unsupported"):
        drivelm_contents(tmp_path, raw_encoding="yuv420")


def test_bare_mcap_from_another_writer(tmp_path, tiny_model):
    """No metadata.yaml, extra topics of a type not installed here, image_transport format strings."""
    bag = mcap_ros2_bag(tmp_path / "vehicle.mcap", jpeg_frames())
    info = bag_topic_info(bag)
    assert info["/tf"].msgtype == "tf2_msgs/msg/TFMessage" and info["/imu"].count == 20
    assert info["/cam_front/image_raw/compressed"].msgtype == "sensor_msgs/msg/CompressedImage"
    records = evaluate(bag, tiny_params(tiny_model))
    assert [(r.query_id, r.status) for r in records] == [("m0", "ok"), ("m1", "ok")], [
        r.status_message for r in records
    ]
    # The same file in a folder without metadata.yaml (and next to a second recording): read directly.
    folder = tmp_path / "copied_out"
    folder.mkdir()
    (folder / "vehicle_0.mcap").write_bytes(bag.read_bytes())
    assert bag_files(folder) == [folder / "vehicle_0.mcap"]
    again = evaluate(folder, tiny_params(tiny_model))
    assert [r.token_ids for r in again] == [r.token_ids for r in records]


def test_bag_eval_cli_default_parameters_use_the_bundled_model(tmp_path):
    """`litevlm bag eval BAG --out X` with model_dir "" (the default): the bundled model answers,
    as the node does (it used to answer pipeline_error ... model not loaded)."""
    bag = mcap_ros2_bag(tmp_path / "v.mcap", jpeg_frames(1))
    out = tmp_path / "eval.jsonl"
    run = subprocess.run([sys.executable, "-m", "litevlm_runtime.cli", "bag", "eval", str(bag), "--out", str(out),
                          "--set", "warmup=false", "--set", "max_new_tokens=4"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    assert all(r["answer"] for r in rows)


def qos(reliability, durability, depth=0, history="UNKNOWN"):
    from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime

    never = QosTime(9223372036, 854775807)
    return Qos(QosHistory[history], depth, QosReliability[reliability], QosDurability[durability], never, never,
               QosLiveliness.AUTOMATIC, never, False)


def test_rosbags_sqlite3_with_recorded_qos_and_extra_topics(tmp_path):
    """Recorded QoS survives the bag (rosbags sqlite3, then the same .db3 without metadata.yaml)
    and becomes the replay QoS; by default only the node's topics are chosen."""
    from rosbags.rosbag2 import StoragePlugin, Writer

    store = typestore()
    image, tf = "sensor_msgs/msg/CompressedImage", "tf2_msgs/msg/TFMessage"
    sensor = [qos("BEST_EFFORT", "VOLATILE", 5, "KEEP_LAST")]
    latched = [qos("RELIABLE", "TRANSIENT_LOCAL"), qos("RELIABLE", "TRANSIENT_LOCAL")]
    path = tmp_path / "rec"
    with Writer(path, version=9, storage_plugin=StoragePlugin.SQLITE3) as w:
        conns = {t: w.add_connection(t, image, typestore=store, offered_qos_profiles=sensor)
                 for t in [camera_topic(c, raw=False) for c in CAMERAS]}
        conns["/tf_static"] = w.add_connection("/tf_static", tf, typestore=store, offered_qos_profiles=latched)
        conns["/litevlm/query"] = w.add_connection("/litevlm/query", "litevlm_msgs/msg/Query", typestore=store)
        TF = store.types[tf]
        w.write(conns["/tf_static"], 1, store.serialize_cdr(TF(transforms=[]), tf))
    (path / "metadata.yaml").unlink()
    [db3] = bag_files(path)
    info = bag_topic_info(db3)
    assert set(info) == set(conns)

    from rclpy.qos import DurabilityPolicy, HistoryPolicy, ReliabilityPolicy

    cam = replay_qos(info["/cam_front/image_raw/compressed"].qos)
    assert (cam.reliability, cam.durability, cam.history, cam.depth) == \
        (ReliabilityPolicy.BEST_EFFORT, DurabilityPolicy.VOLATILE, HistoryPolicy.KEEP_LAST, 5)
    static = replay_qos(info["/tf_static"].qos)
    assert (static.reliability, static.durability, static.depth) == \
        (ReliabilityPolicy.RELIABLE, DurabilityPolicy.TRANSIENT_LOCAL, 100)     # depth not recorded
    none = replay_qos(info["/litevlm/query"].qos)  # nothing recorded
    assert (none.reliability, none.durability, none.depth) == (
        ReliabilityPolicy.RELIABLE,
        DurabilityPolicy.VOLATILE,
        100,
    )
    assert replay_qos(info["/tf_static"].qos, reliable=True).durability == DurabilityPolicy.VOLATILE
    mixed = replay_qos(sensor + latched)
    assert (mixed.reliability, mixed.durability) == (ReliabilityPolicy.BEST_EFFORT, DurabilityPolicy.VOLATILE)
    # A reliable subscriber (the node's query subscription) gets nothing from a best-effort
    # writer: the replayer says so.
    from rclpy.qos import QoSProfile

    from litevlm_runtime.bag.dds import _qos_mismatch

    assert "requests reliable" in _qos_mismatch(cam, QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    assert _qos_mismatch(none, QoSProfile(depth=10, reliability=ReliabilityPolicy.BEST_EFFORT)) is None

    params = load_node_params(None)
    assert select_topics(info, params) == [*params["camera_topics"], "/litevlm/query"]
    assert select_topics(info, params, topics=["/tf_static", "/nope"], progress=lambda m: None) == ["/tf_static"]
    assert set(select_topics(info, params, all_topics=True)) == set(conns)


def test_camera_topics_not_in_the_bag_are_named(tmp_path, tiny_model):
    bag = write_bag(drivelm_contents(png_frames(tmp_path / "f"), raw_encoding="bayer_rggb8"), tmp_path / "bag")
    # camera_topics given (here: the shipped compressed names, explicitly) are used as given; the
    # default is resolved from the bag instead (test_bag_as_it_comes.py)
    given = [f"/{c.lower()}/image_raw/compressed" for c in CAMERAS[:5]] + ["/cam_back_right/other"]
    for call in (lambda: evaluate(bag, tiny_params(tiny_model) | {"camera_topics": given}),
                 lambda: select_topics(bag_topic_info(bag), load_node_params(None))):
        with pytest.raises(InputError) as e:
            call()
        assert "none of the node's camera topics" in str(e.value) and "/cam_back/image_raw" in str(e.value)


@pytest.mark.parametrize("make, words", [
    (lambda p: p / "absent", "no such bag"),
    (lambda p: p, "neither a rosbag2 folder"),
    (lambda p: (p / "notes.txt").write_text("x") and p / "notes.txt", "not a rosbag2 bag"),
    (lambda p: (p / "broken.mcap").write_bytes(b"not mcap") and p / "broken.mcap", "cannot read the bag"),
])
def test_not_a_bag_is_a_clear_error(tmp_path, make, words):
    path = make(tmp_path)
    with pytest.raises(InputError, match=words):
        list(read_bag(path))


def test_reuse_summary_compares_first_and_later_questions_per_frame_set():
    from litevlm_runtime.bag.compare import reuse_summary

    def r(stamp, vision, status="ok", reused=()):
        return {"status": status, "frame_stamps_ns": {"CAM_FRONT": stamp, "CAM_BACK": stamp + 1},
                "stage_ms": {"vision": vision}, "reused_cameras": list(reused)}
    rows = [r(1, 40.0), r(1, 4.0, reused=["CAM_FRONT"]), r(1, 0.0, reused=["CAM_FRONT"]), r(2, 60.0),
            r(2, 99.0, status="bad_image"), r(2, 6.0, reused=["CAM_BACK"]), r(3, 50.0)]
    s = reuse_summary(rows)
    assert (s["first"], s["first_ms"], s["later"], s["later_ms"], s["answers_reusing"]) == (3, 50.0, 3, 4.0, 3)
    assert reuse_summary([r(1, 40.0), r(2, 30.0)]) is None          # no later question: nothing to say
    # Batched answers come out as they finish: the first question is the earliest asked, not answered.
    asked = [dict(r(1, 2.0, reused=["CAM_FRONT"]), query_stamp_ns=20), dict(r(1, 70.0), query_stamp_ns=10)]
    s = reuse_summary(asked)
    assert (s["first_ms"], s["later_ms"]) == (70.0, 2.0)


def test_bag_eval_carries_follow_ups_and_sampling(tmp_path, tiny_model):
    """Query.follow_up_of, temperature and seed written into a bag reach the server in bag eval:
    the follow-up is answered on its first turn's frames (a newer set came between) and equals its
    conversation from scratch; the sampled query is the pipeline's at that temperature and seed."""
    from litevlm_runtime.bag.io import BagContents, CameraFrame
    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.ros.parameters import pipeline_options_from

    def frame_set(seed, stamp_ns):
        rng = np.random.default_rng(seed)
        out = {}
        for cam in CAMERAS:
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (36, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
            out[cam] = buf.getvalue()
        for cam, data in out.items():
            contents.frames[cam].append(CameraFrame(stamp_ns, data, format="png"))
        return out

    contents = BagContents()
    s = 1_000_000_000
    first = frame_set(1, 10 * s)
    contents.queries.append(
        QueryRequest("What is in front of the ego vehicle?", stamp_ns=10 * s + s // 10, query_id="t1")
    )
    frame_set(2, 11 * s)
    contents.queries.append(QueryRequest("Is it moving?", stamp_ns=11 * s + s // 10, query_id="t2", follow_up_of="t1"))
    contents.queries.append(QueryRequest("Is it moving?", stamp_ns=11 * s + s // 5, query_id="t3", follow_up_of="gone"))
    contents.queries.append(
        QueryRequest("What is behind?", stamp_ns=11 * s + s // 4, query_id="t4", temperature=2.0, seed=5)
    )
    bag = write_bag(contents, tmp_path / "bag")
    params = tiny_params(tiny_model, max_new_tokens="4")
    records = {r.query_id: r for r in evaluate(bag, params)}
    assert [records[i].status for i in ("t1", "t2", "t3", "t4")] == ["ok", "ok", "bad_follow_up", "ok"]
    assert records["t2"].frame_stamps_ns == records["t1"].frame_stamps_ns == {c: 10 * s for c in CAMERAS}
    assert records["t2"].turn == 2 and records["t2"].reused_tokens > 0
    pipe = Pipeline.from_pretrained(tiny_model, pipeline_options_from(params))
    scratch = pipe.answer(
        first, QueryRequest("Is it moving?", history=[("What is in front of the ego vehicle?", records["t1"].text)])
    )
    assert records["t2"].token_ids == scratch.token_ids
    newer = {c: contents.frames[c][-1].data for c in CAMERAS}
    assert (
        records["t4"].token_ids
        == pipe.answer(newer, QueryRequest("What is behind?", temperature=2.0, seed=5)).token_ids
    )
    assert records["t4"].token_ids != pipe.answer(newer, "What is behind?").token_ids
