"""Calibration traffic: the questions, and what every stage call of their answers fed its graph.

Questions with their camera frames (a DriveLM-layout QA.json with its images, or a rosbag2 of
camera streams and queries) go through the PyTorch pipeline, whose stages run on the bundle's
bucket shapes (engines/bound_stages.py). Every stage call records the exact tensors its ONNX graph
would receive: selected-camera pixels padded to the tile bucket, prompt embeddings (template +
visual tokens + question) with positions, masks and the KV cache, decode steps, LM-head rows. A
reservoir sample (fixed seed) keeps at most N calls per graph, so decode steps late in an answer
are as likely to be kept as early ones. `samples_for` then gives each graph its calibration
samples: its own calls, or those of the same stage's nearest bucket fitted to its shape, or (the
batched step, which one-at-a-time traffic never calls) single decode steps side by side.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ...bag.io import QUERY_TOPIC, camera_topic, read_bag
from ...cameras import CAMERAS
from ...engines.bound_stages import bound_engines
from ...engines.cuda_graph import StaticStage
from ...engines.stages import DecoderStage, DraftStage, HeadStage, PrefillStage, VisionStage
from ...errors import InputError, LiteVLMError
from ...evaluation.data import frame_images, load_frames
from ...pipeline.request import QueryRequest
from ...ros.convert import request_from_query, request_from_question
from ...serving.images import payload_from_msg, to_pipeline_image
from ...stages.prompt import is_blank
from .plan import data_kind

MAX_SAMPLE_BYTES = 1 << 30          # per graph: a decoder sample carries the whole KV cache


@dataclass
class Query:
    images: dict                  # camera -> bytes / path / RGB array
    request: QueryRequest         # the question as asked (its id: the source's, else q<N>)
    reference: str = ""           # ground-truth answer when the source has one


def queries_from_qa(path: Path, frames_root: Path | None = None) -> list[Query]:
    """Every question of a DriveLM v1.1 file with its frame's six images (frame order, then the
    file's question order)."""

    root = Path(frames_root) if frames_root else Path(path).parent
    out = []
    for frame in load_frames(path):
        images = {cam: p.read_bytes() for cam, p in frame_images(root, frame).items()}
        out += [Query(images, QueryRequest(q.question, query_id=q.id), q.answer) for q in frame.questions]
    return out


def queries_from_bag(path: Path, camera_topics: dict[str, str] | None = None) -> list[Query]:
    """Each query of a rosbag2 (litevlm_msgs/Query on /litevlm/query, or std_msgs/String
    questions) with the newest frame of every camera at that moment, read with the bag tooling
    of litevlm_runtime.bag.io. A Query message becomes its request through ros/convert.py, as the
    node and `bag eval` read it: every field it carries (choices, temperature, ...) applies."""

    if camera_topics:
        topics = {t: c for c, t in camera_topics.items()}
    else:   # the default names of both image transports
        topics = {camera_topic(c, raw): c for c in CAMERAS for raw in (False, True)}
    latest: dict[str, object] = {}
    out = []
    for _, topic, msgtype, raw, reader in read_bag(Path(path)):
        if topic in topics:
            payload = payload_from_msg(reader.deserialize(raw, msgtype))
            latest[topics[topic]] = to_pipeline_image(topics[topic], payload)
        elif topic == QUERY_TOPIC or msgtype == "std_msgs/msg/String":
            msg = reader.deserialize(raw, msgtype)
            request = request_from_query(msg) if topic == QUERY_TOPIC else request_from_question(msg)
            if all(c in latest for c in CAMERAS) and not is_blank(request.question):
                out.append(Query(dict(latest), replace(request, query_id=request.query_id or f"q{len(out)}")))
    if not out:
        raise InputError(f"{path}: no query with all six cameras before it")
    return out


def load_queries(data: Path, frames_root: Path | None = None) -> list[Query]:
    if data_kind(data) == "qa":
        return queries_from_qa(Path(data), frames_root)
    return queries_from_bag(Path(data))


def split_queries(queries: list[Query], calibrate: int, evaluate: int, seed: int = 0) -> tuple[list, list]:
    """Disjoint calibration and evaluation questions, drawn with a fixed seed."""
    order = list(range(len(queries)))
    random.Random(seed).shuffle(order)
    calib = [queries[i] for i in order[:calibrate]]
    held_out = [queries[i] for i in order[calibrate:calibrate + evaluate]]
    if not calib:
        raise InputError("no calibration questions")
    return calib, held_out


class Recorder:
    """Reservoir-samples the inputs of every stage call, per graph file."""

    def __init__(self, per_graph: int, seed: int = 0):
        self.per_graph = per_graph
        self.rng = random.Random(seed)
        self.samples: dict[str, list[dict[str, np.ndarray]]] = {}
        self.calls: dict[str, int] = {}
        self.limit: dict[str, int] = {}

    def record(self, graph: str, inputs: dict[str, torch.Tensor]) -> None:
        n = self.calls[graph] = self.calls.get(graph, 0) + 1
        if graph not in self.limit:
            nbytes = sum(t.numel() * t.element_size() for t in inputs.values())
            self.limit[graph] = max(1, min(self.per_graph, MAX_SAMPLE_BYTES // nbytes))
        kept = self.samples.setdefault(graph, [])
        slot = len(kept) if len(kept) < self.limit[graph] else self.rng.randrange(n)
        if slot < self.limit[graph]:
            snapshot = {k: t.detach().cpu().numpy().copy() for k, t in inputs.items()}
            if slot == len(kept):
                kept.append(snapshot)
            else:
                kept[slot] = snapshot


class RecordingStage:
    def __init__(self, inner, graph: str, inputs: dict, recorder: Recorder):
        self.inner, self.graph, self.inputs, self.recorder = inner, graph, inputs, recorder

    def run(self) -> None:
        self.recorder.record(self.graph, self.inputs)
        self.inner.run()


def collect_traffic(pipe, bundle, queries: list[Query], recorder: Recorder, progress=print) -> None:
    """Answer `queries` with `pipe` (torch) on the bundle's buckets, recording every graph's inputs."""

    rt = pipe.rt
    modules = {"vision": VisionStage(rt.model, rt.pos_embed).eval(), "decoder": DecoderStage(rt.lm).eval(),
               "prefill": PrefillStage(rt.lm).eval(), "head": HeadStage(rt.lm).eval()}
    sizes = bundle.sizes()
    if rt.draft is not None:
        modules["eagle_draft"] = DraftStage(rt.draft).eval()
    else:
        sizes["eagle_draft"] = ()

    def bind(stage, bucket, inputs, outputs):
        graph = bundle.graphs(stage)[bucket]["file"]
        return RecordingStage(StaticStage(modules[stage], inputs, outputs), graph, inputs, recorder)

    rt.engines = bound_engines(rt, sizes, bind, "calibration")
    answer_queries(pipe, queries, "calibration traffic", progress)


def answer_queries(pipe, queries: list[Query], label: str, progress=print) -> None:
    """Answer each query (its traffic is what the caller records); one it refuses is skipped, said."""
    for i, q in enumerate(queries):
        try:
            pipe.answer(q.images, q.request)
        except InputError as exc:
            progress(f"  skipped {q.request.query_id}: {exc}")
            continue
        progress(f"[{label} {i + 1}/{len(queries)}] {q.request.question[:60]}")


# ------------------------------------------------------------------------------- samples per graph
ROW_INPUTS = {"vision": ("pixels",), "decoder": ("embeds", "positions", "mask_cache", "mask_new"),
              "prefill": ("embeds", "positions", "mask_new"), "head": ("hidden",)}


def fit_sample(stage: str, sample: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """A recorded call re-shaped to another bucket of the same stage, as the engine itself would
    present it: the first `rows` rows/tiles (a shorter prompt is a prefix of a longer one under
    the causal mask), or padded (zero rows that see only themselves; repeated tiles)."""
    out = dict(sample)
    have = sample[ROW_INPUTS[stage][0]].shape[0]
    if rows <= have:
        for name in ROW_INPUTS[stage]:
            out[name] = sample[name][:rows]
        if "mask_new" in sample:
            out["mask_new"] = sample["mask_new"][:rows, :rows]
        return out
    if stage == "vision":
        out["pixels"] = np.concatenate([sample["pixels"]] * -(-rows // have))[:rows]
        return out
    for name in ROW_INPUTS[stage]:
        if name == "mask_new":
            continue
        pad = np.zeros((rows - have,) + sample[name].shape[1:], dtype=sample[name].dtype)
        out[name] = np.concatenate([sample[name], pad])
    if "mask_new" in sample:
        mask_new = np.eye(rows, dtype=bool)
        mask_new[:have, :have] = sample["mask_new"]
        out["mask_new"] = mask_new
    return out


def batched_samples(graph: dict, manifest: dict, recorder: Recorder) -> tuple[list, str]:
    """Calls of the batched step (calibration answers one query at a time, so none are
    recorded) made of recorded single-row decode steps, as in-flight batching presents them:
    B of them side by side, each row with its own history in its own KV region, the identity
    as mask_new. B: the graph's largest bucket; every recorded step is used once (cycled to
    fill the last batch)."""
    ones = [g for g in manifest["graphs"] if g["stage"] == "decoder" and g["bucket"] == 1]
    steps = recorder.samples.get(ones[0]["file"]) if ones else None
    if not steps:
        raise LiteVLMError("calibration traffic never reached a single-row decode step: answer longer questions")
    b = max(graph["buckets"])
    samples = []
    for start in range(0, len(steps), b):
        rows = [steps[(start + i) % len(steps)] for i in range(b)]
        sample = {"embeds": np.concatenate([r["embeds"] for r in rows]),
                  "positions": np.concatenate([r["positions"] for r in rows]),
                  "mask_cache": np.concatenate([r["mask_cache"] for r in rows]),
                  "mask_new": np.eye(b, dtype=bool)}
        for cache in ("k_cache", "v_cache", "k_cache_scale", "v_cache_scale"):     # (scales: a quantized cache)
            if cache in rows[0]:
                sample[cache.replace("cache", "regions")] = np.stack([r[cache] for r in rows])
        samples.append(sample)
    return samples, f"calls of {ones[0]['file']}, {b} per batched call"


def samples_for(graph: dict, manifest: dict, recorder: Recorder) -> tuple[list, str]:
    """The graph's own recorded calls; for a bucket the traffic never reached, the calls of the
    same stage's nearest bucket (largest first), fitted to this one; for the batched step,
    single-row decode steps side by side."""
    if graph["stage"] == "decoder_batch":
        return batched_samples(graph, manifest, recorder)
    own = recorder.samples.get(graph["file"])
    if own:
        return own, "own calls"
    siblings = sorted(
        (g for g in manifest["graphs"] if g["stage"] == graph["stage"] and recorder.samples.get(g["file"])),
        key=lambda g: (g["bucket"] < graph["bucket"], abs(g["bucket"] - graph["bucket"])),
    )
    if not siblings:
        raise LiteVLMError(f"calibration traffic never reached the {graph['stage']} stage: answer more questions")
    src = siblings[0]
    return ([fit_sample(graph["stage"], s, graph["bucket"]) for s in recorder.samples[src["file"]]],
            f"calls of {src['file']} fitted to {graph['bucket']}")
