"""The DDS side: replaying a bag into a running node (`bag replay`, each topic with the QoS it was
recorded with) and recording its answers (`bag record`). The only bag module that needs rclpy.

Ctrl-C (SIGINT) or SIGTERM ends either tool between two messages: it stops, closes its files and
its ROS context in order, and prints its summary line (rclpy's own signal handler would shut the
context down under a publish or a spin: a traceback, and no summary)."""

from __future__ import annotations

import contextlib
import importlib
import json
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import rclpy
from litevlm_msgs.msg import Answer
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import deserialize_message, serialize_message
from rclpy.signals import SignalHandlerOptions
from rosbags.interfaces import QosDurability, QosHistory, QosReliability
from rosbags.rosbag2 import StoragePlugin, Writer

from ..errors import InputError
from ..ros.bag_types import camera_topics_from_bag, parse_remaps, published_name
from ..ros.convert import ns_of
from ..ros.dds_env import use_large_data_profile
from ..ros.messages import record_from_msg
from ..ros.params_file import load_node_params
from .damage import decode
from .ids import replay_tag, split, tagged
from .io import TopicInfo, bag_topic_info, missing_cameras, read_bag, typestore

ANSWER_TYPE = "litevlm_msgs/msg/Answer"


@contextlib.contextmanager
def interruptible():
    """An Event set by SIGINT or SIGTERM while the block runs (the tool then ends its loop), and
    rclpy initialised without its own signal handlers; the handlers are restored after."""
    stop = threading.Event()
    old = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    try:
        yield stop
    finally:
        if rclpy.ok():
            rclpy.shutdown()
        for sig, handler in old.items():
            signal.signal(sig, handler)


def rclpy_type(msgtype: str):
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
    if theirs.reliability == ReliabilityPolicy.RELIABLE and ours.reliability == ReliabilityPolicy.BEST_EFFORT:
        return "requests reliable, the bag recorded best_effort"
    if theirs.durability == DurabilityPolicy.TRANSIENT_LOCAL and ours.durability == DurabilityPolicy.VOLATILE:
        return "requests transient_local, the bag recorded volatile"
    return None


@dataclass(frozen=True)
class ReplayOptions:
    """How `bag replay` publishes a bag (its flags): `rate` divides the recorded timing; `restamp`
    moves header stamps and deadlines to now; `params_file` names the node's parameters (default
    config/drive.yaml) whose topics are published, unless `topics` or `all_topics`; `wait_s` (0: none)
    for the node's query subscription, then `settle_s`; `reliable` overrides the recorded QoS;
    `namespace` and `remaps` (ros2's FROM:=TO) rename the published topics."""
    rate: float = 1.0
    restamp: bool = True
    params_file: Path | None = None
    topics: list[str] | None = None
    all_topics: bool = False
    wait_s: float = 10.0
    settle_s: float = 1.0
    reliable: bool = False
    namespace: str = ""
    remaps: list[str] | None = None


def replay(bag: Path, options: ReplayOptions = ReplayOptions(), progress=print) -> int:
    """Publish the bag's messages with their original timing (divided by `options.rate`): the topics
    the node subscribes to (its parameters, `options.params_file`, default config/drive.yaml), or
    `options.topics`, or all of them; each with the QoS the bag recorded for it (replay_qos). A topic
    whose message type is not installed here is skipped, with one warning per type. Before publishing:
    one wait of at most wait_s (0: none) for the node's query subscription, then settle_s so that the
    camera subscriptions have matched too (a best-effort reader drops what arrives before)."""
    if options.rate <= 0:
        raise InputError(f"--rate must be > 0, got {options.rate}")
    reliable = options.reliable
    info = bag_topic_info(bag)
    params = load_node_params(options.params_file)
    params = camera_topics_from_bag(params, {t: i.msgtype for t, i in info.items()}, progress)
    remap_rules = parse_remaps(options.remaps)
    tag = replay_tag()
    chosen = select_topics(info, params, options.topics, options.all_topics, progress)
    types, missing = {}, defaultdict(list)
    for t in chosen:
        try:
            types[t] = rclpy_type(info[t].msgtype)
        except (ImportError, AttributeError, ValueError) as exc:
            missing[(info[t].msgtype, f"{type(exc).__name__}: {exc}")].append(t)
    for (msgtype, why), names in missing.items():
        progress(f"replay: skipping {', '.join(names)}: message type {msgtype} is not installed ({why})")
    if not types:
        raise InputError(f"{bag}: no topic left to publish")
    use_large_data_profile()
    with interruptible() as stop:
        node = rclpy.create_node("litevlm_bag_replay")
        try:
            pubs, qos = {}, {}
            for t, msg_type in types.items():
                qos[t] = replay_qos(info[t].qos, reliable)
                pubs[t] = node.create_publisher(msg_type, published_name(t, options.namespace, remap_rules), qos[t])
                recorded = "as recorded" if info[t].qos and not reliable else "default"
                shown = t if pubs[t].topic_name == t else f"{t} as {pubs[t].topic_name}"
                progress(f"replay: {shown} ({info[t].msgtype}, {info[t].count} messages; QoS {_qos_text(qos[t])}, "
                         f"{recorded})")
            progress(f"replay: query ids published as ID@replay-{tag} (bag record gives back the bag's ids)")
            # One bounded wait, for the node's query subscription (the question topic, or any, without one).
            target = next((t for t in (params["query_topic"], params["question_topic"]) if t in pubs), None)
            wait_for_node(pubs, target, options.wait_s, options.settle_s, stop, progress)
            for t, pub in pubs.items():
                for sub in node.get_subscriptions_info_by_topic(pub.topic_name):
                    why = _qos_mismatch(qos[t], sub.qos_profile)
                    if why:
                        progress(f"replay: {t}: subscriber {sub.node_name} {why}: it receives nothing (--reliable)")
            n, seconds = publish_bag(bag, node, pubs, types, options, tag, stop, progress)
            if stop.is_set():
                progress(f"replay: interrupted, {n} messages in {seconds:.2f} s")
            else:
                progress(f"replay: done, {n} messages in {seconds:.2f} s")
                time.sleep(0.5)   # let reliable writers flush before the participant goes away
        finally:
            node.destroy_node()
    return 130 if stop.is_set() else 0


def wait_for_node(pubs: dict, target: str | None, wait_s: float, settle_s: float, stop, progress) -> None:
    """At most wait_s (0: none) for a subscriber on `target` (None: on any topic), then settle_s."""
    if wait_s <= 0:
        return

    def matched():
        return (pubs[target].get_subscription_count() > 0 if target
                else any(p.get_subscription_count() > 0 for p in pubs.values()))
    t0 = time.monotonic()
    while not matched() and time.monotonic() - t0 < wait_s and not stop.is_set():
        time.sleep(0.05)
    what = target or "any topic"
    if matched():
        progress(f"replay: {what} has a subscriber after {time.monotonic() - t0:.1f} s")
        stop.wait(settle_s)
    else:
        progress(f"replay: no subscriber on {what} after {wait_s:.0f} s; publishing anyway")


def publish_bag(bag: Path, node, pubs: dict, types: dict, options: ReplayOptions, tag: str, stop,
                progress) -> tuple[int, float]:
    """Publish the bag's messages on `pubs` in time (until `stop` is set), at options.rate, restamped
    where options.restamp: (messages, seconds)."""
    rate, restamp = options.rate, options.restamp
    n, first_t, start_wall, start_clock = 0, None, time.monotonic(), node.get_clock().now().nanoseconds
    for t, topic, msgtype, raw, reader in read_bag(bag, pubs):
        if first_t is None:
            first_t = t
        due = start_wall + (t - first_t) / 1e9 / rate
        if stop.wait(max(0.0, due - time.monotonic())):
            break
        # rosbags parses the bytes first (pure Python: a clean error): rclpy's deserialize_message
        # crashed the process (SIGSEGV) on a damaged message, and a subscriber would get them raw.
        decode(bag, topic, t, reader.deserialize, raw, msgtype)
        is_query = msgtype == "litevlm_msgs/msg/Query"
        msg = deserialize_message(raw, types[topic]) if restamp or is_query else raw
        if is_query:
            msg.id = tagged(msg.id, tag)          # unique per replay (ids.py)
            if getattr(msg, "follow_up_of", ""):
                msg.follow_up_of = tagged(msg.follow_up_of, tag)      # the earlier query, as this replay named it
        if restamp:
            shift = lambda ns: start_clock + int((ns - first_t) / rate)  # noqa: E731
            if hasattr(msg, "header"):
                set_stamp(msg.header.stamp, shift(ns_of(msg.header.stamp)))
            if hasattr(msg, "deadline") and (msg.deadline.sec or msg.deadline.nanosec):
                set_stamp(msg.deadline, shift(ns_of(msg.deadline)))
        pubs[topic].publish(msg)
        n += 1
        if is_query:
            progress(f"replay: {(time.monotonic() - start_wall):7.2f} s  query published ({n} messages)")
    return n, time.monotonic() - start_wall


def set_stamp(t, ns: int) -> None:
    t.sec, t.nanosec = ns // 1_000_000_000, ns % 1_000_000_000


def answer_row(msg, received_ns: int) -> dict:
    """A litevlm_msgs/Answer as the JSON-lines row (AnswerRecord.to_json), plus `received_ns`
    and `e2e_ms` (receipt minus the query's stamp)."""
    rec = record_from_msg(msg)
    rec.follow_up_of = split(rec.follow_up_of)[0]
    row = rec.to_json()
    row["received_ns"] = received_ns
    row["e2e_ms"] = (received_ns - rec.query_stamp_ns) / 1e6
    return row


def record(out: Path, topic: str = "/litevlm/answer", count: int | None = None, timeout_s: float | None = None,
           progress=print, bag_out: Path | None = None, storage: str = "mcap") -> int:
    """Append every litevlm_msgs/Answer on `topic` to a JSON-lines file (and, with bag_out, to a
    rosbag2 as received) until `count` answers, `timeout_s` seconds, or Ctrl-C. Prints
    "record: ready" once an answer publisher is matched; a topic that carries another type (the
    JSON mirror's std_msgs/String, say) is refused naming it."""
    if bag_out is not None and Path(bag_out).exists():
        raise InputError(f"{bag_out} exists; rosbag2 will not overwrite a bag")
    use_large_data_profile()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    received, t0 = [0], time.monotonic()
    with interruptible() as stop, out.open("w") as fh, answers_bag(bag_out, topic, storage) as write_bag:
        node = rclpy.create_node("litevlm_bag_record")

        def on_answer(msg: Answer) -> None:
            row = answer_row(msg, node.get_clock().now().nanoseconds)
            row["query_id"], row["replay"] = split(msg.query_id)     # the bag's id back (ids.py)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            write_bag(row["received_ns"], msg)
            received[0] += 1
            progress(f"record: {msg.query_id} [{row['status']}] e2e {row['e2e_ms']:.1f} ms "
                     f"(pipeline {row['total_ms']:.1f}, queue {row['queue_ms']:.1f})")

        node.create_subscription(
            Answer, topic, on_answer, QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        )
        announced = False
        try:
            while not stop.is_set():
                rclpy.spin_once(node, timeout_sec=0.05)
                if not announced:
                    announced = publisher_matched(node, topic, progress)
                if count is not None and received[0] >= count:
                    break
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    progress(f"record: timeout after {timeout_s:.0f} s with {received[0]} answers")
                    break
        finally:
            node.destroy_node()
    ended = " (interrupted)" if stop.is_set() else ""
    progress(f"record: {received[0]} answers -> {out}{ended}")
    return 0 if count is None or received[0] >= count else 1


def publisher_matched(node, topic: str, progress) -> bool:
    """Whether `topic` has a publisher of answers (then "record: ready" is printed); an InputError
    naming the topic and its type when its publishers publish something else."""
    published = {info.topic_type for info in node.get_publishers_info_by_topic(topic)}
    if published and ANSWER_TYPE not in published:
        raise InputError(f"--topic {topic} carries {', '.join(sorted(published))}, not {ANSWER_TYPE}: record the "
                         "node's answer topic (e.g. /litevlm/answer; the JSON mirror answer_json is for other tools)")
    if published:
        progress("record: ready")
        return True
    return False


@contextlib.contextmanager
def answers_bag(bag_out: Path | None, topic: str, storage: str):
    """write(received_ns, msg) into a rosbag2 at `bag_out` (a no-op without one)."""
    if bag_out is None:
        yield lambda ns, msg: None
        return
    writer = Writer(Path(bag_out), version=9,
                    storage_plugin={"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}[storage])
    writer.open()
    conn = writer.add_connection(topic, ANSWER_TYPE, typestore=typestore())
    try:
        yield lambda ns, msg: writer.write(conn, ns, serialize_message(msg))     # rclpy's CDR is rosbag2's CDR
    finally:
        writer.close()
