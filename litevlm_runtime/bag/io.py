"""Bag files: what goes into a bag (camera frames, raw or compressed, and timed queries), writing
it with rosbags (MCAP by default, or sqlite3), and reading any rosbag2 back: a folder with
metadata.yaml, a folder of .mcap/.db3 files without one, or a bare .mcap/.db3 file."""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from ..cameras import CAMERAS
from ..errors import InputError
from ..pipeline.request import QueryRequest
from ..ros.convert import query_fields
from ..serving.images import raw_encoding, rgb_to_raw
from .damage import damaged, guarded

# rosbags and PIL are imported inside the functions that open a bag or decode an image: the names here
# (topics, CameraFrame, BagContents) are imported by callers that never do, and rosbags takes a tenth of a
# second to load.

QUERY_TOPIC = "/litevlm/query"


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
class BagContents:
    frames: dict[str, list[CameraFrame]] = field(default_factory=lambda: {c: [] for c in CAMERAS})
    queries: list[QueryRequest] = field(default_factory=list)   # each at its stamp_ns (its header and bag time)


def msg_definitions_dir() -> Path:
    """litevlm_msgs' .msg files: the source tree's, else the installed share/ copy."""
    src = Path(__file__).resolve().parents[2] / "ros2_ws" / "src" / "litevlm_msgs" / "msg"
    if src.is_dir():
        return src
    return Path(sys.prefix) / "share" / "litevlm_msgs" / "msg"


def typestore():
    """rosbags type store for ROS 2 Kilted plus litevlm_msgs/{Query,Answer,ObjectRef}."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    types = {}
    for name in ("ObjectRef", "Query", "Answer"):
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
                msg = Query(
                    **query_fields(item, lambda ns: _time(store, ns), lambda stamp: Header(stamp=stamp, frame_id=""))
                )
                writer.write(qconn, t, store.serialize_cdr(msg, Query.__msgtype__))
    return out


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
    except Exception as exc:  # noqa: BLE001 - damage rosbags does not name (damage.py)
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
            read = 0
            for conn, t, raw in guarded(path, reader.messages(connections=conns)):
                read += 1
                yield t, conn.topic, conn.msgtype, raw, reader
            # rosbags checks no MCAP CRC, and zeroed bytes over a record's header end its chunk
            # early without an error: the messages the bag's own index counts are the check.
            listed = sum(c.msgcount for c in conns)
            if 0 < read < listed:
                raise InputError(f"{path}: damaged bag: {read} of the {listed} messages its index lists are "
                                 "readable (zeroed or overwritten bytes)")
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
            out[c.topic] = TopicInfo(
                c.msgtype, qos + (prev.qos if prev else ()), c.msgcount + (prev.count if prev else 0)
            )
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
    images = [
        t for t, msgtype in topics.items() if msgtype in ("sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage")
    ]
    return (f"none of the node's camera topics ({', '.join(camera_topics)}) is in the bag; its image topics: "
            f"{', '.join(images) or 'none'} (set camera_topics in the parameters, or --set camera_topics=[...])")
