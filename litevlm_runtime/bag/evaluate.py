"""`bag eval`: the bag through the node's own serving code (QueryServer + Pipeline) in bag time,
without DDS: answers agree with a replay into the node (frames are matched as the node matches
them: serving/settings.py frame_match; a query waits, in bag time, as long as the node would)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..bundled import DEFAULT_MODEL
from ..cameras import CAMERAS
from ..errors import InputError
from ..pipeline.pipeline import Pipeline
from ..ros.bag_types import camera_topics_from_bag, checked_folder
from ..ros.convert import ns_of, request_from_query, request_from_question
from ..ros.parameters import pipeline_options_from
from ..serving.explainer import Explainer
from ..serving.frame_store import Frame
from ..serving.images import payload_from_msg
from ..serving.record import AnswerRecord
from ..serving.server import QueryServer
from ..serving.settings import ServerSettings, check_window
from ..weights.integrity import integrity_label
from .damage import decode
from .io import bag_topics, missing_cameras, read_bag


def evaluate(
    bag: Path, params: dict, on_record=None, load=None, explainer: Explainer | None = None
) -> list[AnswerRecord]:
    """Replay the bag through QueryServer + Pipeline in bag time, one query at a time. `load`:
    returns the pipeline for these params (a fleet worker's, loaded once for many bags); default:
    load it from params["model_dir"]. `explainer`: every answer is explained, and handed to it
    after its record (an inline Explainer: `bag eval --explain` writes the MCAP with it)."""

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
    check_window(settings, pipeline_options_from(params).temporal)     # as the node's configure does
    if explainer is not None:
        settings = replace(settings, explain="always")
    clock = [0]
    server = QueryServer(settings, publish, clock_ns=lambda: clock[0], explainer=explainer)
    try:
        # Warm-up as the node does, so that latencies are comparable between eval and a replay.
        model_dir = params.get("model_dir") or str(DEFAULT_MODEL)     # "": the bundled model, as the node does
        def factory():
            checked_folder(model_dir, params.get("require_manifest", False))   # as the node does
            return Pipeline.from_pretrained(model_dir, pipeline_options_from(params))
        server.load(load or factory, warmup=params["warmup"])
        server.integrity = integrity_label(model_dir) if load is None else ""
    except Exception:
        pass    # load_error is kept: every query is answered pipeline_error, as the node does
    server.active = server.pipeline is not None

    def serve_ready(now: int) -> None:
        """What the node's 10 ms timer and worker do, in bag time, up to `now`: a query whose
        match_wait_s ends before it is matched at that moment, one whose frames are in now; each
        then served, one at a time."""
        while (ends := server.next_wait_end()) is not None and ends < now:
            serve_at(ends)
        serve_at(now)

    def serve_at(now: int) -> None:
        clock[0] = now
        server.retry_pending(now)
        while (req := server.queue.get(timeout=0)) is not None:
            server.serve(req, now_ns=now)
            server.prefetch(req)        # idle until the next message, as the node's worker is

    t = 0
    for t, topic, msgtype, raw, reader in read_bag(bag, [*topics, params["query_topic"], params["question_topic"]]):
        serve_ready(t)                  # (what the node did before this message arrived)
        clock[0] = t
        if topic in topics:
            msg = decode(bag, topic, t, reader.deserialize, raw, msgtype)
            server.frames.add(Frame(topics[topic], ns_of(msg.header.stamp), payload_from_msg(msg)))
        elif topic in (params["query_topic"], params["question_topic"]):
            msg = decode(bag, topic, t, reader.deserialize, raw, msgtype)
            server.submit(request_from_query(msg) if topic == params["query_topic"] else request_from_question(msg),
                          now_ns=t)
        serve_ready(t)
    # The bag has ended: what still waits for frames waits no more (the node's match_wait_s passes).
    serve_ready(t + int(settings.match_wait_s * 1e9) + 1)
    return records
