"""Rosbag2 tooling: make a bag of six camera streams plus timed questions, replay it over DDS,
record the answers, evaluate the same bag without DDS, and compare two runs.

Bags are written and read with the pure-Python `rosbags` package (rosbag2_py is not available as
a wheel), MCAP by default. Any rosbag2 is read: a folder with metadata.yaml, a folder of
.mcap/.db3 files without one, or a bare .mcap/.db3 file. Its CDR bytes are what rclpy
(de)serializes, so the replayer reads messages with rosbags and hands them to rclpy unchanged
except for the re-stamping below; it publishes only the node's topics by default, each with the
QoS the bag recorded.

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

from ..pipeline.answer import STAGES
from ..cameras import CAMERAS
from ..errors import InputError
from ..bag.damage import damaged, decode, guarded
from ..bag.ids import replay_tag, split, tagged
from .bag_types import camera_topics_from_bag, checked_folder, parse_remaps, published_name
from ..serving.server import STATUS_CODES, AnswerRecord, QueryServer, ServerSettings

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
    fault-injection bags), or sensor_msgs/Image when `encoding` is set (data = rows of pixels,
    `step` bytes each, little-endian)."""
    stamp_ns: int
    data: bytes
    format: str = "jpeg"
    encoding: str | None = None     # any of images.RAW_ENCODINGS -> sensor_msgs/Image
    width: int = 0
    height: int = 0
    step: int = 0

    @property
    def raw(self) -> bool:
        return self.encoding is not None


def raw_frame(stamp_ns: int, jpeg_or_png: bytes, encoding: str, name: str = "frame") -> CameraFrame:
    """Decode an image into a sensor_msgs/Image payload in `encoding` (no row padding)."""
    from PIL import Image

    from ..serving.images import raw_encoding, rgb_to_raw

    img = Image.open(io.BytesIO(jpeg_or_png))
    try:
        data = rgb_to_raw(np.asarray(img.convert("RGB")), encoding)
    except InputError as exc:
        raise InputError(f"{name}: {exc}") from None
    enc = raw_encoding(encoding)
    return CameraFrame(stamp_ns, data, "", encoding, img.width, img.height,
                       step=img.width * enc.channels * enc.bits // 8)


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
    budget_ms: float = 0.0         # the Query's latency budget (0: the node's default)


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
                msg = RawImage(header=header, height=item.height, width=item.width, encoding=item.encoding,
                               is_bigendian=0, step=item.step or len(item.data) // max(item.height, 1),
                               data=np.frombuffer(item.data, dtype=np.uint8))
                writer.write(conns[key], t, store.serialize_cdr(msg, RawImage.__msgtype__))
            elif kind == "frame":
                msg = CompressedImage(header=header, format=item.format, data=np.frombuffer(item.data, dtype=np.uint8))
                writer.write(conns[key], t, store.serialize_cdr(msg, CompressedImage.__msgtype__))
            else:
                msg = Query(header=header, id=item.id, text=item.text, deadline=_time(store, item.deadline_ns),
                            budget_ms=float(item.budget_ms))
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
    from ..serving.images import raw_encoding as check_encoding

    if raw_encoding:
        check_encoding(raw_encoding)
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
                    contents.frames[cam].append(raw_frame(t, data, raw_encoding, name=str(path)))
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
STORAGE_SUFFIXES = (".mcap", ".db3")


def bag_files(path: Path) -> list[Path]:
    """What rosbags' AnyReader opens for `path`: a rosbag2 folder with its metadata.yaml as it
    is; a folder without one (a recording copied out of its folder, or one whose recorder died
    before writing it) as the storage files in it; a bare .mcap or .db3 file as it is. rosbags
    reads MCAP and sqlite3 storage files directly (schemas and QoS are in the files)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such bag")
    if path.is_dir():
        if (path / "metadata.yaml").is_file():
            return [path]
        files = sorted(p for p in path.iterdir() if p.suffix in STORAGE_SUFFIXES)
        if not files:
            raise InputError(f"{path}: neither a rosbag2 folder (no metadata.yaml) nor a folder of "
                             f"{' / '.join(STORAGE_SUFFIXES)} files")
        return files
    if path.suffix in STORAGE_SUFFIXES:
        return [path]
    raise InputError(f"{path}: not a rosbag2 bag (a folder, or a {' / '.join(STORAGE_SUFFIXES)} file)")


def _reader(path: Path):
    from rosbags.highlevel import AnyReader, AnyReaderError
    from rosbags.rosbag2 import ReaderError

    reader = AnyReader(bag_files(path), default_typestore=typestore())
    try:
        reader.open()
    except (AnyReaderError, ReaderError) as exc:
        raise InputError(f"{path}: cannot read the bag ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - damage rosbags does not name (bag_damage.py)
        raise damaged(path, "opening it", exc) from None
    return reader


def read_bag(path: Path, topics: Iterable[str] | None = None):
    """Yields (log_time_ns, topic, msgtype, rawdata, reader) in time order, of every topic or only
    of `topics` (the others are not read)."""
    reader = _reader(path)
    try:
        wanted = None if topics is None else set(topics)
        conns = [c for c in reader.connections if wanted is None or c.topic in wanted]
        if conns:
            for conn, t, raw in guarded(path, reader.messages(connections=conns)):
                yield t, conn.topic, conn.msgtype, raw, reader
    finally:
        reader.close()


@dataclass(frozen=True)
class TopicInfo:
    msgtype: str
    qos: tuple          # rosbags Qos profiles the recorded publishers offered (empty: not recorded)
    count: int


def bag_topic_info(path: Path) -> dict[str, TopicInfo]:
    reader = _reader(path)
    try:
        out: dict[str, TopicInfo] = {}
        for c in reader.connections:
            qos = tuple(getattr(c.ext, "offered_qos_profiles", ()) or ())
            prev = out.get(c.topic)
            out[c.topic] = TopicInfo(c.msgtype, qos + (prev.qos if prev else ()), c.msgcount + (prev.count if prev else 0))
        return out
    finally:
        reader.close()


def bag_topics(path: Path) -> dict[str, str]:
    return {topic: info.msgtype for topic, info in bag_topic_info(path).items()}


def missing_cameras(topics: dict[str, str], camera_topics: list[str]) -> str | None:
    """None when some camera topic of the node is in the bag (topic -> msgtype), else why not,
    naming the image topics the bag has."""
    if any(t in topics for t in camera_topics):
        return None
    images = [t for t, msgtype in topics.items() if msgtype in ("sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage")]
    return (f"none of the node's camera topics ({', '.join(camera_topics)}) is in the bag; its image topics: "
            f"{', '.join(images) or 'none'} (set camera_topics in the parameters, or --set camera_topics=[...])")


# --------------------------------------------------------------------------------------------
# eval: the node's QueryServer on the bag, no DDS
def load_node_params(params_file: Path | None, overrides: dict | None = None) -> dict:
    """ros__parameters of the node from its YAML (the same file `litevlm drive` reads)."""
    import yaml

    from .node import NODE_NAME, PARAMETERS, config_dir
    from .parameters import flatten, node_section, pipeline_settings
    from .topics import shipped_topic_names

    params = dict(PARAMETERS) | {s.key: s.default for s in pipeline_settings()}
    path = Path(params_file) if params_file else config_dir() / "drive.yaml"
    doc = yaml.safe_load(path.read_text()) or {}
    given = flatten(node_section(doc, NODE_NAME))
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise InputError(f"{path}: unknown parameter(s) {', '.join(unknown)}")
    params.update(given)
    for k, v in (overrides or {}).items():
        if k not in params:
            raise InputError(f"unknown parameter {k!r}")
        params[k] = yaml.safe_load(v) if isinstance(v, str) else v
    # The names the node uses in the root namespace with the shipped remappings (ros/topics.py).
    return params | shipped_topic_names(params["camera_topics"])


def evaluate(bag: Path, params: dict, on_record=None) -> list[AnswerRecord]:
    """Replay the bag through QueryServer + Pipeline in bag time, one query at a time."""
    from ..serving.frame_store import Frame
    from ..serving.images import payload_from_msg
    from ..bundled import DEFAULT_MODEL
    from ..pipeline.pipeline import Pipeline
    from .parameters import pipeline_options_from

    params = camera_topics_from_bag(params, bag_topics(bag))     # camera_topics not set: the bag's own
    topics = dict(zip(params["camera_topics"], CAMERAS))
    why = missing_cameras(bag_topics(bag), params["camera_topics"])
    if why:
        raise InputError(f"{bag}: {why}")
    records: list[AnswerRecord] = []

    def publish(rec):
        records.append(rec)
        if on_record:
            on_record(rec)

    settings = ServerSettings(cameras=CAMERAS, max_skew_s=params["max_skew_s"], max_frame_age_s=params["max_frame_age_s"],
                              frame_history=params["frame_history"], queue_size=params["queue_size"],
                              overflow_policy=params["overflow_policy"], max_question_chars=params["max_question_chars"],
                              match_wait_s=params["match_wait_s"], max_future_s=params["max_future_s"])
    clock = [0]
    server = QueryServer(settings, publish, clock_ns=lambda: clock[0])
    try:
        # Warm-up as the node does, so that latencies are comparable between eval and a replay.
        model_dir = params.get("model_dir") or str(DEFAULT_MODEL)     # "": the bundled model, as the node does
        def factory():
            checked_folder(model_dir, params.get("require_manifest", False))   # as the node does
            return Pipeline.from_pretrained(model_dir, pipeline_options_from(params))
        server.load(factory, warmup=params["warmup"])
    except Exception:
        pass    # load_error is kept: every query is answered pipeline_error, as the node does
    server.active = server.pipeline is not None
    for t, topic, msgtype, raw, reader in read_bag(bag, [*topics, params["query_topic"], params["question_topic"]]):
        clock[0] = t
        if topic in topics:
            msg = decode(bag, topic, t, reader.deserialize, raw, msgtype)
            stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
            server.frames.add(Frame(topics[topic], stamp, payload_from_msg(msg)))
        elif topic == params["query_topic"]:
            msg = decode(bag, topic, t, reader.deserialize, raw, msgtype)
            stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
            deadline = msg.deadline.sec * 1_000_000_000 + msg.deadline.nanosec
            # No frames are in flight in a bag: a failed match is final (allow_wait=False). A bag
            # recorded before Query had budget_ms carries its old type: no budget.
            req = server.submit(msg.text, query_id=msg.id, stamp_ns=stamp, deadline_ns=deadline, now_ns=t,
                                allow_wait=False, budget_ms=float(getattr(msg, "budget_ms", 0.0)))
            if req is not None:
                server.queue.drain()        # no DDS, no waiting: serve it now
                server.serve(req, now_ns=t)
                server.prefetch(req)        # idle until the next message, as the node's worker is
        elif topic == params["question_topic"]:
            msg = decode(bag, topic, t, reader.deserialize, raw, msgtype)
            req = server.submit(msg.data, now_ns=t, allow_wait=False)
            if req is not None:
                server.queue.drain()
                server.serve(req, now_ns=t)
                server.prefetch(req)        # idle until the next message, as the node's worker is
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
            d[split(r["query_id"])[0]].append(r)      # a replay's tagged id is its bag's id (bag_ids.py)
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


def reuse_summary(rows: list[dict]) -> dict | None:
    """Visual reuse over ok answers: the vision stage of the first question answered on each frame
    set (its stamps) against the later ones on the same set; None without a later question."""
    first, later, seen = [], [], set()
    reused = 0
    for r in rows:
        if r.get("status") != "ok" or "vision" not in r.get("stage_ms", {}):
            continue
        key = tuple(sorted(r.get("frame_stamps_ns", {}).items()))
        (later if key in seen else first).append(r["stage_ms"]["vision"])
        seen.add(key)
        reused += bool(r.get("reused_cameras"))
    if not first or not later:
        return None
    return {"first": len(first), "first_ms": float(np.median(first)), "later": len(later),
            "later_ms": float(np.median(later)), "answers_reusing": reused}


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


def node_topics(params: dict) -> list[str]:
    """What the node subscribes to: its six camera topics, the query and the question topic."""
    return [*params["camera_topics"], params["query_topic"], params["question_topic"]]


def select_topics(info: dict[str, TopicInfo], params: dict, topics: list[str] | None = None,
                  all_topics: bool = False, progress=print) -> list[str]:
    """The topics to replay: `topics` as given, every topic with all_topics, else the node's own
    topics that the bag has (a vehicle bag's /tf, /imu, lidar ... stay unpublished)."""
    if all_topics:
        return list(info)
    if topics:
        missing = [t for t in topics if t not in info]
        if missing:
            progress(f"replay: not in the bag, skipped: {', '.join(missing)}")
        chosen = [t for t in topics if t in info]
        if not chosen:
            raise InputError(f"none of --topics is in the bag; it has {', '.join(info)}")
        return chosen
    why = missing_cameras({t: i.msgtype for t, i in info.items()}, params["camera_topics"])
    if why:
        raise InputError(why + ", or --topics")
    chosen = [t for t in node_topics(params) if t in info]
    absent = [t for t in params["camera_topics"] if t not in info]
    if absent:
        progress(f"replay: camera topics not in the bag: {', '.join(absent)}")
    return chosen


def replay_qos(profiles, reliable: bool = False):
    """The QoS to publish a topic with: what its recorded publishers offered (rosbag2 stores
    their profiles per topic), combined as `ros2 bag play` does: reliable unless one offered best
    effort, transient-local only if all did. History and depth as recorded where known (a
    recorder learns them from discovery, which does not carry them: rosbag2 writes "unknown",
    depth 0), else keep-last 100. Nothing recorded (bags written by rosbags, as `bag make` does)
    or `reliable`: reliable, volatile, depth 100."""
    from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
    from rosbags.interfaces import QosDurability, QosHistory, QosReliability

    if not profiles or reliable:
        return QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    best_effort = any(p.reliability == QosReliability.BEST_EFFORT for p in profiles)
    transient = all(p.durability == QosDurability.TRANSIENT_LOCAL for p in profiles)
    keep_all = all(p.history == QosHistory.KEEP_ALL for p in profiles)
    known_depth = all(p.history == QosHistory.KEEP_LAST and p.depth > 0 for p in profiles)
    return QoSProfile(
        history=HistoryPolicy.KEEP_ALL if keep_all else HistoryPolicy.KEEP_LAST,
        depth=max(p.depth for p in profiles) if known_depth else 100,
        reliability=ReliabilityPolicy.BEST_EFFORT if best_effort else ReliabilityPolicy.RELIABLE,
        durability=DurabilityPolicy.TRANSIENT_LOCAL if transient else DurabilityPolicy.VOLATILE,
    )


def _qos_text(q) -> str:
    history = "keep_all" if q.history.name == "KEEP_ALL" else f"depth {q.depth}"
    return f"{q.reliability.name.lower()}, {q.durability.name.lower()}, {history}"


def _qos_mismatch(ours, theirs) -> str | None:
    from rclpy.qos import DurabilityPolicy, ReliabilityPolicy

    if theirs.reliability == ReliabilityPolicy.RELIABLE and ours.reliability == ReliabilityPolicy.BEST_EFFORT:
        return "requests reliable, the bag recorded best_effort"
    if theirs.durability == DurabilityPolicy.TRANSIENT_LOCAL and ours.durability == DurabilityPolicy.VOLATILE:
        return "requests transient_local, the bag recorded volatile"
    return None


def replay(bag: Path, rate: float = 1.0, restamp: bool = True, params_file: Path | None = None,
           topics: list[str] | None = None, all_topics: bool = False, wait_s: float = 10.0,
           settle_s: float = 1.0, reliable: bool = False, progress=print, namespace: str = "",
           remaps: list[str] | None = None) -> int:
    """Publish the bag's messages with their original timing (divided by `rate`): the topics the
    node subscribes to (its parameters, `params_file`, default config/drive.yaml), or `topics`, or
    all of them; each with the QoS the bag recorded for it (replay_qos). A topic whose message type
    is not installed here is skipped, with one warning per type. Before publishing: one wait of
    at most wait_s (0: none) for the node's query subscription, then settle_s so that the
    camera subscriptions have matched too (a best-effort reader drops what arrives before)."""
    import rclpy
    from rclpy.serialization import deserialize_message

    from .node import use_large_data_profile

    if rate <= 0:
        raise InputError(f"--rate must be > 0, got {rate}")
    info = bag_topic_info(bag)
    params = load_node_params(params_file)
    params = camera_topics_from_bag(params, {t: i.msgtype for t, i in info.items()}, progress)
    remap_rules = parse_remaps(remaps)
    tag = replay_tag()
    chosen = select_topics(info, params, topics, all_topics, progress)
    types, missing = {}, defaultdict(list)
    for t in chosen:
        try:
            types[t] = _rclpy_type(info[t].msgtype)
        except (ImportError, AttributeError, ValueError) as exc:
            missing[(info[t].msgtype, f"{type(exc).__name__}: {exc}")].append(t)
    for (msgtype, why), names in missing.items():
        progress(f"replay: skipping {', '.join(names)}: message type {msgtype} is not installed ({why})")
    if not types:
        raise InputError(f"{bag}: no topic left to publish")
    use_large_data_profile()
    rclpy.init()
    node = rclpy.create_node("litevlm_bag_replay")
    pubs, qos = {}, {}
    for t, msg_type in types.items():
        qos[t] = replay_qos(info[t].qos, reliable)
        pubs[t] = node.create_publisher(msg_type, published_name(t, namespace, remap_rules), qos[t])
        recorded = "as recorded" if info[t].qos and not reliable else "default"
        shown = t if pubs[t].topic_name == t else f"{t} as {pubs[t].topic_name}"
        progress(f"replay: {shown} ({info[t].msgtype}, {info[t].count} messages; QoS {_qos_text(qos[t])}, {recorded})")
    progress(f"replay: query ids published as ID@replay-{tag} (bag record gives back the bag's ids)")
    # One bounded wait, for the node's query subscription (the question topic, or any, without one).
    target = next((t for t in (params["query_topic"], params["question_topic"]) if t in pubs), None)
    try:
        if wait_s > 0:
            def matched():
                return (pubs[target].get_subscription_count() > 0 if target
                        else any(p.get_subscription_count() > 0 for p in pubs.values()))
            t0 = time.monotonic()
            while not matched() and time.monotonic() - t0 < wait_s:
                time.sleep(0.05)
            what = target or "any topic"
            if matched():
                progress(f"replay: {what} has a subscriber after {time.monotonic() - t0:.1f} s")
                time.sleep(settle_s)
            else:
                progress(f"replay: no subscriber on {what} after {wait_s:.0f} s; publishing anyway")
        for t, pub in pubs.items():
            for sub in node.get_subscriptions_info_by_topic(pub.topic_name):
                why = _qos_mismatch(qos[t], sub.qos_profile)
                if why:
                    progress(f"replay: {t}: subscriber {sub.node_name} {why}: it receives nothing (--reliable)")
        n, first_t, start_wall, start_clock = 0, None, time.monotonic(), node.get_clock().now().nanoseconds
        for t, topic, msgtype, raw, reader in read_bag(bag, pubs):
            if first_t is None:
                first_t = t
            due = start_wall + (t - first_t) / 1e9 / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            # rosbags parses the bytes first (pure Python: a clean error): rclpy's deserialize_message
            # crashed the process (SIGSEGV) on a damaged message, and a subscriber would get them raw.
            decode(bag, topic, t, reader.deserialize, raw, msgtype)
            if restamp or msgtype == "litevlm_msgs/msg/Query":
                msg = deserialize_message(raw, types[topic])
            if msgtype == "litevlm_msgs/msg/Query":
                msg.id = tagged(msg.id, tag)          # unique per replay (bag_ids.py)
            if restamp:
                shift = lambda ns: start_clock + int((ns - first_t) / rate)  # noqa: E731
                if hasattr(msg, "header"):
                    s = shift(msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec)
                    msg.header.stamp.sec, msg.header.stamp.nanosec = s // 1_000_000_000, s % 1_000_000_000
                if hasattr(msg, "deadline") and (msg.deadline.sec or msg.deadline.nanosec):
                    s = shift(msg.deadline.sec * 1_000_000_000 + msg.deadline.nanosec)
                    msg.deadline.sec, msg.deadline.nanosec = s // 1_000_000_000, s % 1_000_000_000
                pubs[topic].publish(msg)
            else:
                pubs[topic].publish(msg if msgtype == "litevlm_msgs/msg/Query" else raw)
            n += 1
            if msgtype == "litevlm_msgs/msg/Query":
                progress(f"replay: {(time.monotonic() - start_wall):7.2f} s  query published ({n} messages)")
        progress(f"replay: done, {n} messages in {time.monotonic() - start_wall:.2f} s")
        time.sleep(0.5)   # let reliable writers flush before the participant goes away
    finally:
        node.destroy_node()
        rclpy.shutdown()
    return 0


def answer_row(msg, received_ns: int) -> dict:
    """A litevlm_msgs/Answer as the JSON-lines row (AnswerRecord.to_json), plus `received_ns`
    and `e2e_ms` (receipt minus the query's stamp)."""
    stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
    rec = AnswerRecord(
        query_id=msg.query_id, question=msg.question, status=STATUS_NAMES.get(msg.status, f"code{msg.status}"),
        status_message=msg.status_message, answer=msg.answer, token_ids=[int(t) for t in msg.token_ids],
        cameras=list(msg.cameras), stage_ms=dict(zip(msg.stage_names, [float(v) for v in msg.stage_ms])),
        queue_ms=float(msg.queue_ms), visual_tokens=msg.visual_tokens, kept_tokens=msg.kept_tokens,
        input_tokens=msg.input_tokens, decode_steps=msg.decode_steps, accepted_length=float(msg.accepted_length),
        pipeline=msg.pipeline, reused_cameras=list(msg.reused_cameras), degraded=list(msg.degraded),
        budget_ms=float(msg.budget_ms), budget_met=bool(msg.budget_met), query_stamp_ns=stamp,
        frame_stamps_ns={c: s.sec * 1_000_000_000 + s.nanosec for c, s in zip(msg.frame_cameras, msg.frame_stamps)},
    )
    row = rec.to_json()
    row["received_ns"] = received_ns
    row["e2e_ms"] = (received_ns - stamp) / 1e6
    return row


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
        row = answer_row(msg, node.get_clock().now().nanoseconds)
        row["query_id"], row["replay"] = split(msg.query_id)     # the bag's id back (bag_ids.py)
        now = row["received_ns"]
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
