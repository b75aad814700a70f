"""`bag eval`: the bag through the node's own serving code (QueryServer + Pipeline) in bag time,
without DDS: answers agree with a replay into the node."""

from __future__ import annotations

from pathlib import Path

from ..bundled import DEFAULT_MODEL
from ..cameras import CAMERAS
from ..errors import InputError
from ..pipeline.pipeline import Pipeline
from ..ros.bag_types import camera_topics_from_bag, checked_folder
from ..ros.parameters import pipeline_options_from
from ..serving.frame_store import Frame
from ..serving.images import payload_from_msg
from ..serving.server import AnswerRecord, QueryServer
from ..serving.settings import ServerSettings
from .damage import decode
from .io import bag_topics, missing_cameras, read_bag


def evaluate(bag: Path, params: dict, on_record=None, load=None) -> list[AnswerRecord]:
    """Replay the bag through QueryServer + Pipeline in bag time, one query at a time. `load`:
    returns the pipeline for these params (a fleet worker's, loaded once for many bags); default:
    load it from params["model_dir"]."""

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

    settings = ServerSettings.from_values(params, CAMERAS)
    clock = [0]
    server = QueryServer(settings, publish, clock_ns=lambda: clock[0])
    try:
        # Warm-up as the node does, so that latencies are comparable between eval and a replay.
        model_dir = params.get("model_dir") or str(DEFAULT_MODEL)     # "": the bundled model, as the node does
        def factory():
            checked_folder(model_dir, params.get("require_manifest", False))   # as the node does
            return Pipeline.from_pretrained(model_dir, pipeline_options_from(params))
        server.load(load or factory, warmup=params["warmup"])
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
            # recorded before Query had a field carries its old type: the field's default.
            req = server.submit(msg.text, query_id=msg.id, stamp_ns=stamp, deadline_ns=deadline, now_ns=t,
                                allow_wait=False, budget_ms=float(getattr(msg, "budget_ms", 0.0)),
                                choices=list(getattr(msg, "choices", ())), answer_schema=getattr(msg, "answer_schema", ""),
                                temperature=float(getattr(msg, "temperature", 0.0)), seed=int(getattr(msg, "seed", 0)),
                                follow_up_of=getattr(msg, "follow_up_of", ""))
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
