"""The DDS side: replaying a bag into a running node (`bag replay`, each topic with the QoS it was
recorded with) and recording its answers (`bag record`). The only bag module that needs rclpy."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

from ..errors import InputError
from ..ros.bag_types import camera_topics_from_bag, parse_remaps, published_name
from ..ros.node import use_large_data_profile
from ..ros.params_file import load_node_params
from ..serving.server import AnswerRecord
from .compare import STATUS_NAMES
from .damage import decode
from .ids import replay_tag, split, tagged
from .io import TopicInfo, bag_topic_info, missing_cameras, read_bag, typestore


def rclpy_type(msgtype: str):
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
            types[t] = rclpy_type(info[t].msgtype)
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
                msg.id = tagged(msg.id, tag)          # unique per replay (ids.py)
                if getattr(msg, "follow_up_of", ""):
                    msg.follow_up_of = tagged(msg.follow_up_of, tag)      # the earlier query, as this replay named it
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
        follow_up_of=split(getattr(msg, "follow_up_of", ""))[0], turn=int(getattr(msg, "turn", 0)),
        reused_tokens=int(getattr(msg, "reused_tokens", 0)), prompt_sha256=getattr(msg, "prompt_sha256", ""),
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
    from litevlm_msgs.msg import Answer
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from rclpy.serialization import serialize_message


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
        row["query_id"], row["replay"] = split(msg.query_id)     # the bag's id back (ids.py)
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
