"""Rosbag2 tooling: make a bag of six camera streams plus timed questions, replay it over DDS,
record the answers, evaluate the same bag without DDS, and compare two runs.

Bags are written and read with the pure-Python `rosbags` package (rosbag2_py is not available as
a wheel), MCAP by default. Its CDR bytes are what rclpy (de)serializes, so the replayer reads
messages with rosbags and hands them to rclpy unchanged except for the re-stamping below.

Time. A bag keeps the capture times of the frames (nuScenes: 2018). Replaying them as they are
would make every frame look years old to the node, so by default the replayer re-stamps: the
bag's first message maps to the moment the replay starts, and every header stamp (and a query's
deadline) is shifted with it, scaled by 1/rate, like a live rig. `bag eval` uses the bag's own
times as the clock instead; frame matching and answers agree, and frame stamps relative to the
query stamp (`frame_offsets_ms`) agree exactly at rate 1.

JSON lines (one answer per line) are the output of `bag record` and `bag eval`; see
server.AnswerRecord.to_json. `bag record` adds `received_ns` and `e2e_ms` (receipt minus the
query stamp, i.e. query publish -> answer received).
"""

from __future__ import annotations

import io
import json
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from ..answer import STAGES
from ..cameras import CAMERAS
from ..errors import InputError
from .server import STATUS_CODES, AnswerRecord, QueryServer, ServerSettings

QUERY_TOPIC = "/litevlm/query"
STATUS_NAMES = {code: name for name, code in STATUS_CODES.items()}
# Questions for frames that come without DriveLM QA (the sample's n015 scene).
GENERIC_QUESTIONS = (
    "What are the important objects in the current scene?",
    "What should the ego vehicle do next?",
)
CAPTURE_US = re.compile(r"__(\d{16})\.(jpg|jpeg|png)$", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# What goes into a bag
@dataclass
class CameraFrame:
    """One camera message: sensor_msgs/CompressedImage (data = JPEG/PNG bytes, or anything for
    fault-injection bags), or sensor_msgs/Image when `encoding` is set (data = rows of pixels)."""
    stamp_ns: int
    data: bytes
    format: str = "jpeg"
    encoding: str | None = None     # rgb8 | bgr8 | mono8 -> sensor_msgs/Image
    width: int = 0
    height: int = 0

    @property
    def raw(self) -> bool:
        return self.encoding is not None


def raw_frame(stamp_ns: int, jpeg_or_png: bytes, encoding: str) -> CameraFrame:
    """Decode an image into a sensor_msgs/Image payload (rgb8, bgr8 or mono8, no row padding)."""
    from PIL import Image

    img = Image.open(io.BytesIO(jpeg_or_png))
    if encoding == "mono8":
        pixels = np.asarray(img.convert("L"))
    else:
        pixels = np.asarray(img.convert("RGB"))
        if encoding == "bgr8":
            pixels = pixels[:, :, ::-1]
        elif encoding != "rgb8":
            raise InputError(f"raw encoding {encoding!r}: use rgb8, bgr8 or mono8")
    return CameraFrame(stamp_ns, np.ascontiguousarray(pixels).tobytes(), "", encoding, img.width, img.height)


def camera_topic(camera: str, raw: bool) -> str:
    """Default topic names, as image_transport names them: .../image_raw and .../image_raw/compressed."""
    return f"/{camera.lower()}/image_raw" + ("" if raw else "/compressed")


DEFAULT_CAMERA_TOPICS = {c: camera_topic(c, raw=False) for c in CAMERAS}


@dataclass
class BagQuery:
    stamp_ns: int
    text: str
    id: str = ""
    deadline_ns: int = 0


@dataclass
class BagContents:
    frames: dict[str, list[CameraFrame]] = field(default_factory=lambda: {c: [] for c in CAMERAS})
    queries: list[BagQuery] = field(default_factory=list)


def msg_definitions_dir() -> Path:
    """litevlm_msgs' .msg files: the source tree's, else the installed share/ copy."""
    src = Path(__file__).resolve().parents[2] / "ros2_ws" / "src" / "litevlm_msgs" / "msg"
    if src.is_dir():
        return src
    return Path(sys.prefix) / "share" / "litevlm_msgs" / "msg"


def typestore():
    """rosbags type store for ROS 2 Kilted plus litevlm_msgs/{Query,Answer}."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    types = {}
    for name in ("Query", "Answer"):
        text = (msg_definitions_dir() / f"{name}.msg").read_text()
        types.update(get_types_from_msg(text, f"litevlm_msgs/msg/{name}"))
    store.register(types)
    return store


def _time(store, ns: int):
    Time = store.types["builtin_interfaces/msg/Time"]
    return Time(sec=int(ns // 1_000_000_000), nanosec=int(ns % 1_000_000_000))


def write_bag(contents: BagContents, out: Path, storage: str = "mcap",
              camera_topics: dict[str, str] | None = None, query_topic: str = QUERY_TOPIC) -> Path:
    """Write frames (CompressedImage) and queries (litevlm_msgs/Query) in time order."""
    from rosbags.rosbag2 import StoragePlugin, Writer

    out = Path(out)
    if out.exists():
        raise InputError(f"{out} exists; rosbag2 will not overwrite a bag")
    raw = {cam: bool(frames) and frames[0].raw for cam, frames in contents.frames.items()}
    topics = camera_topics or {cam: camera_topic(cam, raw.get(cam, False)) for cam in CAMERAS}
    store = typestore()
    Header = store.types["std_msgs/msg/Header"]
    CompressedImage = store.types["sensor_msgs/msg/CompressedImage"]
    RawImage = store.types["sensor_msgs/msg/Image"]
    Query = store.types["litevlm_msgs/msg/Query"]
    plugin = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}[storage]
    events = []   # (time, order, kind, camera/query, payload)
    for cam, frames in contents.frames.items():
        for f in frames:
            events.append((f.stamp_ns, 0, "frame", cam, f))
    for i, q in enumerate(contents.queries):
        events.append((q.stamp_ns, 1, "query", i, q))
    events.sort(key=lambda e: (e[0], e[1], str(e[3])))
    with Writer(out, version=9, storage_plugin=plugin) as writer:
        conns = {cam: writer.add_connection(topics[cam], (RawImage if raw.get(cam) else CompressedImage).__msgtype__,
                                            typestore=store) for cam in CAMERAS}
        qconn = writer.add_connection(query_topic, Query.__msgtype__, typestore=store)
        for t, _, kind, key, item in events:
            header = Header(stamp=_time(store, t), frame_id="" if kind == "query" else key.lower())
            if kind == "frame" and raw.get(key):
                if not item.raw:
                    raise InputError(f"{key}: a camera topic carries one type; mixed raw and compressed frames")
                step = len(item.data) // max(item.height, 1)
                msg = RawImage(header=header, height=item.height, width=item.width, encoding=item.encoding,
                               is_bigendian=0, step=step, data=np.frombuffer(item.data, dtype=np.uint8))
                writer.write(conns[key], t, store.serialize_cdr(msg, RawImage.__msgtype__))
            elif kind == "frame":
                msg = CompressedImage(header=header, format=item.format, data=np.frombuffer(item.data, dtype=np.uint8))
                writer.write(conns[key], t, store.serialize_cdr(msg, CompressedImage.__msgtype__))
            else:
                msg = Query(header=header, id=item.id, text=item.text, deadline=_time(store, item.deadline_ns))
                writer.write(qconn, t, store.serialize_cdr(msg, Query.__msgtype__))
    return out


# --------------------------------------------------------------------------------------------
# Sources: DriveLM (real nuScenes frames + QA) and SynthDrive (same layout, rendered)
def _downscale(data: bytes, max_width: int | None) -> bytes:
    if not max_width:
        return data
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    if img.width <= max_width:
        return data
    img = img.convert("RGB").resize((max_width, round(img.height * max_width / img.width)), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _drivelm_questions(qa_files: Iterable[Path]) -> dict[str, list[str]]:
    """CAM_FRONT image file name -> that key frame's questions, interleaving the categories
    (perception, prediction, planning, behavior) so the first few cover all of them."""
    by_frame: dict[str, list[str]] = {}
    for qa_file in qa_files:
        data = json.loads(Path(qa_file).read_text())
        if not isinstance(data, dict):
            continue
        for scene in data.values():
            if not isinstance(scene, dict) or not isinstance(scene.get("key_frames"), dict):
                continue      # not DriveLM QA (SynthDrive's ground_truth.json, synthdrive.json)
            for key_frame in scene["key_frames"].values():
                front = Path(key_frame["image_paths"]["CAM_FRONT"]).name
                cats = [[qa["Q"] for qa in key_frame["QA"].get(c, [])] for c in ("perception", "prediction", "planning", "behavior")]
                interleaved = [q for group in _zip_longest(cats) for q in group]
                by_frame[front] = interleaved
    return by_frame


def _zip_longest(lists):
    for i in range(max((len(x) for x in lists), default=0)):
        yield [x[i] for x in lists if i < len(x)]


def drivelm_contents(folder: Path, max_frames: int | None = None, questions_per_frame: int = 2,
                     max_width: int | None = None, query_delay_s: float = 0.2, query_spacing_s: float = 0.15,
                     scene_gap_s: float = 2.0, synthetic_period_s: float = 0.5,
                     raw_encoding: str | None = None) -> BagContents:
    """Key frames of a DriveLM-layout folder (samples/CAM_X/*.jpg + QA json files) as six
    camera streams at their capture times, with that frame's DriveLM questions asked
    `query_delay_s` after the frame set (then every `query_spacing_s`).

    Capture times come from the nuScenes file names (trailing 16-digit microseconds); files
    without one (rendered data) are put on a `synthetic_period_s` timeline. Scenes (file-name
    prefix before "__") follow each other with `scene_gap_s` between them."""
    folder = Path(folder)
    samples = folder / "samples" if (folder / "samples").is_dir() else folder
    if not all((samples / c).is_dir() for c in CAMERAS):
        raise InputError(f"{folder}: expected samples/CAM_X/ folders for {', '.join(CAMERAS)}")
    questions = _drivelm_questions(sorted(folder.glob("*.json")))
    # scene -> camera -> [(capture_ns or None, path)]
    scenes: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for cam in CAMERAS:
        for path in sorted((samples / cam).iterdir()):
            if path.suffix.lower() not in (".jpg", ".jpeg", ".png"):
                continue
            m = CAPTURE_US.search(path.name)
            # nuScenes: the log name before "__" is the scene; rendered frames have no capture
            # time and all go on one synthetic timeline, in file-name order.
            scene = path.name.split("__")[0] if (m and "__" in path.name) else "~synthetic"
            scenes[scene][cam].append((int(m.group(1)) * 1000 if m else None, path))
    contents = BagContents()
    cursor_ns = None          # where the next scene starts on the bag's timeline
    n_sets = 0
    def has_qa(scene):
        return any(path.name in questions for _, path in scenes[scene]["CAM_FRONT"])

    # Scenes with DriveLM QA first (so that --max-frames keeps real questions), then by time.
    for scene in sorted(scenes, key=lambda s: (not has_qa(s), min((t or 0) for c in scenes[s].values() for t, _ in c))):
        per_cam = {c: sorted(scenes[scene][c], key=lambda x: (x[0] or 0, x[1].name)) for c in CAMERAS}
        counts = {len(v) for v in per_cam.values()}
        if len(counts) != 1:
            raise InputError(f"{folder}: scene {scene!r} has different frame counts per camera: "
                             + ", ".join(f"{c} {len(v)}" for c, v in per_cam.items()))
        n = counts.pop()
        first = min((t for v in per_cam.values() for t, _ in v if t is not None), default=None)
        base = 1_700_000_000 * 10**9 if cursor_ns is None else cursor_ns
        shift = 0 if (cursor_ns is None and first is not None) else (base - (first or 0))
        last_ns = (first + shift) if first is not None else base
        for k in range(n):
            if max_frames is not None and n_sets >= max_frames:
                break
            stamps = {}
            for cam in CAMERAS:
                t, path = per_cam[cam][k]
                t = (t + shift) if t is not None else base + int(k * synthetic_period_s * 1e9)
                stamps[cam] = t
                original = path.read_bytes()
                data = _downscale(original, max_width)
                if raw_encoding:
                    contents.frames[cam].append(raw_frame(t, data, raw_encoding))
                else:
                    fmt = "jpeg" if (data is not original or path.suffix.lower() != ".png") else "png"
                    contents.frames[cam].append(CameraFrame(t, data, fmt))
            set_ns = max(stamps.values())
            front = per_cam["CAM_FRONT"][k][1].name
            qs = questions.get(front) or list(GENERIC_QUESTIONS)
            for j, text in enumerate(qs[:questions_per_frame]):
                t = set_ns + int((query_delay_s + j * query_spacing_s) * 1e9)
                contents.queries.append(BagQuery(t, text, id=f"f{n_sets}q{j}"))
                last_ns = max(last_ns, t)
            last_ns = max(last_ns, set_ns)
            n_sets += 1
        cursor_ns = last_ns + int(scene_gap_s * 1e9)
    if n_sets == 0:
        raise InputError(f"{folder}: no frames found")
    return contents


# --------------------------------------------------------------------------------------------
# Reading a bag back
def read_bag(path: Path):
    """Yields (log_time_ns, topic, msgtype, rawdata, connection) in time order."""
    from rosbags.highlevel import AnyReader

    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such bag")
    with AnyReader([path], default_typestore=typestore()) as reader:
        for conn, t, raw in reader.messages():
            yield t, conn.topic, conn.msgtype, raw, reader


def bag_topics(path: Path) -> dict[str, str]:
    from rosbags.highlevel import AnyReader

    with AnyReader([Path(path)], default_typestore=typestore()) as reader:
        return {c.topic: c.msgtype for c in reader.connections}


# --------------------------------------------------------------------------------------------
# eval: the node's QueryServer on the bag, no DDS
def load_node_params(params_file: Path | None, overrides: dict | None = None) -> dict:
    """ros__parameters of the node from its YAML (the same file `litevlm drive` reads)."""
    import yaml

    from .node import NODE_NAME, PARAMETERS, config_dir

    params = dict(PARAMETERS)
    path = Path(params_file) if params_file else config_dir() / "drive.yaml"
    doc = yaml.safe_load(path.read_text()) or {}
    section = doc.get(NODE_NAME) or doc.get("/**") or {}
    params.update(section.get("ros__parameters", {}))
    for k, v in (overrides or {}).items():
        if k not in PARAMETERS:
            raise InputError(f"unknown parameter {k!r}")
        params[k] = yaml.safe_load(v) if isinstance(v, str) else v
    return params


def evaluate(bag: Path, params: dict, on_record=None) -> list[AnswerRecord]:
    """Replay the bag through QueryServer + Pipeline in bag time, one query at a time."""
    from .frame_store import Frame
    from .images import payload_from_msg
    from .node import pipeline_options
    from ..pipeline import Pipeline

    topics = dict(zip(params["camera_topics"], CAMERAS))
    records: list[AnswerRecord] = []

    def publish(rec):
        records.append(rec)
        if on_record:
            on_record(rec)

    settings = ServerSettings(cameras=CAMERAS, max_skew_s=params["max_skew_s"], max_frame_age_s=params["max_frame_age_s"],
                              frame_history=params["frame_history"], queue_size=params["queue_size"],
                              overflow_policy=params["overflow_policy"], max_question_chars=params["max_question_chars"],
                              match_wait_s=params["match_wait_s"])
    clock = [0]
    server = QueryServer(settings, publish, clock_ns=lambda: clock[0])
    try:
        # Warm-up as the node does, so that latencies are comparable between eval and a replay.
        server.load(lambda: Pipeline.from_pretrained(params["model_dir"], pipeline_options(params)),
                    warmup=params["warmup"])
    except Exception:
        pass    # load_error is kept: every query is answered pipeline_error, as the node does
    server.active = server.pipeline is not None
    for t, topic, msgtype, raw, reader in read_bag(bag):
        clock[0] = t
        if topic in topics:
            msg = reader.deserialize(raw, msgtype)
            stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
            server.frames.add(Frame(topics[topic], stamp, payload_from_msg(msg)))
        elif topic == params["query_topic"]:
            msg = reader.deserialize(raw, msgtype)
            stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
            deadline = msg.deadline.sec * 1_000_000_000 + msg.deadline.nanosec
            # No frames are in flight in a bag: a failed match is final (allow_wait=False).
            req = server.submit(msg.text, query_id=msg.id, stamp_ns=stamp, deadline_ns=deadline, now_ns=t,
                                allow_wait=False)
            if req is not None:
                server.queue.drain()        # no DDS, no waiting: serve it now
                server.serve(req, now_ns=t)
        elif topic == params["question_topic"]:
            msg = reader.deserialize(raw, msgtype)
            req = server.submit(msg.data, now_ns=t, allow_wait=False)
            if req is not None:
                server.queue.drain()
                server.serve(req, now_ns=t)
    return records


# --------------------------------------------------------------------------------------------
# compare two JSON-lines runs
ANSWER_FIELDS = ("status", "answer", "token_ids", "cameras")


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{i}: not JSON ({exc})") from None
    return rows


@dataclass
class Comparison:
    differences: list[str]
    latency_rows: list[tuple[str, float, float, float, float]]   # stage, A p50, B p50, A p90, B p90
    matched: int

    @property
    def ok(self) -> bool:
        return not self.differences


def compare_runs(a_rows: list[dict], b_rows: list[dict]) -> Comparison:
    diffs = []
    by_id: list[dict[str, list[dict]]] = []
    for name, rows in (("A", a_rows), ("B", b_rows)):
        d = defaultdict(list)
        for r in rows:
            d[r["query_id"]].append(r)
        for qid, rs in d.items():
            if len(rs) > 1:
                diffs.append(f"{qid}: answered {len(rs)} times in {name}")
        by_id.append(d)
    a, b = by_id
    for qid in sorted(set(a) - set(b)):
        diffs.append(f"{qid}: only in A")
    for qid in sorted(set(b) - set(a)):
        diffs.append(f"{qid}: only in B")
    common = [q for q in a if q in b]
    for qid in common:
        ra, rb = a[qid][0], b[qid][0]
        for f in ANSWER_FIELDS:
            if ra.get(f) != rb.get(f):
                diffs.append(f"{qid}: {f} differs: A {ra.get(f)!r} / B {rb.get(f)!r}")
    rows = []
    for stage in (*STAGES, "total"):
        def vals(d):
            out = []
            for q in common:
                r = d[q][0]
                if r.get("status") == "ok":
                    out.append(r["total_ms"] if stage == "total" else r.get("stage_ms", {}).get(stage, 0.0))
            return out
        va, vb = vals(a), vals(b)
        if va and vb:
            rows.append((stage, float(np.median(va)), float(np.median(vb)),
                         float(np.percentile(va, 90)), float(np.percentile(vb, 90))))
    return Comparison(diffs, rows, len(common))


def latency_table(rows: list[dict]) -> list[tuple[str, float, float, int]]:
    """Median and p90 per stage (and total, queue, end-to-end and transport when recorded) over ok answers."""
    ok = [r for r in rows if r.get("status") == "ok"]
    out = []
    for stage in (*STAGES, "total", "queue", "e2e", "transport"):
        if stage in STAGES:
            v = [r["stage_ms"][stage] for r in ok if stage in r.get("stage_ms", {})]
        elif stage == "total":
            v = [r["total_ms"] for r in ok]
        elif stage == "queue":
            v = [r.get("queue_ms", 0.0) for r in ok]
        elif stage == "e2e":
            v = [r["e2e_ms"] for r in ok if "e2e_ms" in r]
        else:   # transport: end-to-end minus what the node spent (queue wait + pipeline)
            v = [r["e2e_ms"] - r["total_ms"] - r.get("queue_ms", 0.0) for r in ok if "e2e_ms" in r]
        if v:
            out.append((stage, float(np.median(v)), float(np.percentile(v, 90)), len(v)))
    return out


# --------------------------------------------------------------------------------------------
# DDS side: replay and record (rclpy imported lazily: make/eval/compare work without it)
def _rclpy_type(msgtype: str):
    import importlib

    pkg, _, name = msgtype.split("/")
    return getattr(importlib.import_module(f"{pkg}.msg"), name)


def replay(bag: Path, rate: float = 1.0, restamp: bool = True, wait_s: float = 30.0, settle_s: float = 1.0,
           progress=print) -> int:
    """Publish the bag's messages with their original timing (divided by `rate`). Waits until
    every topic has a subscriber (up to wait_s), then `settle_s` more so that both ends of every
    match are ready (a best-effort reader drops what arrives before it has matched)."""
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from rclpy.serialization import deserialize_message

    from .node import use_large_data_profile

    if rate <= 0:
        raise InputError(f"--rate must be > 0, got {rate}")
    use_large_data_profile()
    topics = bag_topics(bag)
    rclpy.init()
    node = rclpy.create_node("litevlm_bag_replay")
    qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    pubs = {t: node.create_publisher(_rclpy_type(mt), t, qos) for t, mt in topics.items()}
    types = {t: _rclpy_type(mt) for t, mt in topics.items()}
    try:
        t0 = time.monotonic()
        while any(p.get_subscription_count() == 0 for p in pubs.values()):
            if time.monotonic() - t0 > wait_s:
                lonely = [t for t, p in pubs.items() if p.get_subscription_count() == 0]
                progress(f"replay: no subscriber after {wait_s:.0f} s on {', '.join(lonely)}; publishing anyway")
                break
            time.sleep(0.05)
        time.sleep(settle_s)
        n, first_t, start_wall, start_clock = 0, None, time.monotonic(), node.get_clock().now().nanoseconds
        for t, topic, msgtype, raw, _ in read_bag(bag):
            if first_t is None:
                first_t = t
            due = start_wall + (t - first_t) / 1e9 / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if restamp:
                msg = deserialize_message(raw, types[topic])
                shift = lambda ns: start_clock + int((ns - first_t) / rate)  # noqa: E731
                if hasattr(msg, "header"):
                    s = shift(msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec)
                    msg.header.stamp.sec, msg.header.stamp.nanosec = s // 1_000_000_000, s % 1_000_000_000
                if hasattr(msg, "deadline") and (msg.deadline.sec or msg.deadline.nanosec):
                    s = shift(msg.deadline.sec * 1_000_000_000 + msg.deadline.nanosec)
                    msg.deadline.sec, msg.deadline.nanosec = s // 1_000_000_000, s % 1_000_000_000
                pubs[topic].publish(msg)
            else:
                pubs[topic].publish(raw)
            n += 1
            if msgtype == "litevlm_msgs/msg/Query":
                progress(f"replay: {(time.monotonic() - start_wall):7.2f} s  query published ({n} messages)")
        progress(f"replay: done, {n} messages in {time.monotonic() - start_wall:.2f} s")
        time.sleep(0.5)   # let reliable writers flush before the participant goes away
    finally:
        node.destroy_node()
        rclpy.shutdown()
    return 0


def record(out: Path, topic: str = "/litevlm/answer", count: int | None = None, timeout_s: float | None = None,
           progress=print, bag_out: Path | None = None, storage: str = "mcap") -> int:
    """Append every litevlm_msgs/Answer on `topic` to a JSON-lines file (and, with bag_out, to a
    rosbag2 as received) until `count` answers, `timeout_s` seconds, or Ctrl-C. Prints
    "record: ready" once an answer publisher is matched."""
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from rclpy.serialization import serialize_message

    from litevlm_msgs.msg import Answer

    from .node import use_large_data_profile

    use_large_data_profile()
    rclpy.init()
    node = rclpy.create_node("litevlm_bag_record")
    received = [0]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fh = out.open("w")
    writer = conn = None
    if bag_out is not None:
        from rosbags.rosbag2 import StoragePlugin, Writer

        if Path(bag_out).exists():
            raise InputError(f"{bag_out} exists; rosbag2 will not overwrite a bag")
        store = typestore()
        writer = Writer(Path(bag_out), version=9,
                        storage_plugin={"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}[storage])
        writer.open()
        conn = writer.add_connection(topic, "litevlm_msgs/msg/Answer", typestore=store)

    def on_answer(msg: Answer) -> None:
        now = node.get_clock().now().nanoseconds
        stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
        rec = AnswerRecord(
            query_id=msg.query_id, question=msg.question, status=STATUS_NAMES.get(msg.status, f"code{msg.status}"),
            status_message=msg.status_message, answer=msg.answer, token_ids=[int(t) for t in msg.token_ids],
            cameras=list(msg.cameras), stage_ms=dict(zip(msg.stage_names, [float(v) for v in msg.stage_ms])),
            queue_ms=float(msg.queue_ms), visual_tokens=msg.visual_tokens, kept_tokens=msg.kept_tokens,
            input_tokens=msg.input_tokens, decode_steps=msg.decode_steps, accepted_length=float(msg.accepted_length),
            query_stamp_ns=stamp,
            frame_stamps_ns={c: s.sec * 1_000_000_000 + s.nanosec for c, s in zip(msg.frame_cameras, msg.frame_stamps)},
        )
        row = rec.to_json()
        row["received_ns"] = now
        row["e2e_ms"] = (now - stamp) / 1e6
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        if writer is not None:
            writer.write(conn, now, serialize_message(msg))     # rclpy's CDR is rosbag2's CDR
        received[0] += 1
        progress(f"record: {msg.query_id} [{row['status']}] e2e {row['e2e_ms']:.1f} ms "
                 f"(pipeline {row['total_ms']:.1f}, queue {row['queue_ms']:.1f})")

    node.create_subscription(Answer, topic, on_answer, QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE))
    t0 = time.monotonic()
    announced = False
    try:
        while rclpy.ok():
            rclpy.spin_once(node, timeout_sec=0.05)
            if not announced and node.count_publishers(topic) > 0:
                progress("record: ready")
                announced = True
            if count is not None and received[0] >= count:
                break
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                progress(f"record: timeout after {timeout_s:.0f} s with {received[0]} answers")
                break
    except KeyboardInterrupt:
        pass
    finally:
        fh.close()
        if writer is not None:
            writer.close()
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    progress(f"record: {received[0]} answers -> {out}")
    return 0 if count is None or received[0] >= count else 1
