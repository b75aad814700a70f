"""Post-training quantization of an export bundle from real pipeline traffic, with NVIDIA ModelOpt.

1. Traffic. Questions with their camera frames (a DriveLM-layout QA.json with its images, or a
   rosbag2 of camera streams and queries) go through the PyTorch pipeline, whose stages run on
   the bundle's bucket shapes (bound_stages.py). Every stage call records the exact tensors its
   ONNX graph would receive: selected-camera pixels padded to the tile bucket, prompt embeddings
   (template + visual tokens + question) with positions, masks and the KV cache, decode steps,
   LM-head rows. A reservoir sample (fixed seed) keeps at most N calls per graph, so decode steps
   late in an answer are as likely to be kept as early ones.
2. Quantization. Each graph is quantized by `modelopt.onnx.quantization.quantize` from its own
   samples: INT8 or FP8 Q/DQ, both of which ONNX Runtime's CPU kernels execute as written (FP8:
   QuantizeLinear/DequantizeLinear to float8e4m3fn, opset 19+; `--check` proves it pair by pair,
   export/qdq.py), and TensorRT builds its engines from. INT4: weight-only, the project's stored
   weights (or ModelOpt's AWQ) written as blocked DequantizeLinear (export/int4_onnx.py). Graph
   inputs and outputs keep their dtypes, so the new bundle binds exactly like the original one.
3. Accuracy. Held-out questions (disjoint from the calibration questions) are answered by the
   unquantized and the quantized bundle through ONNX Runtime; reported: greedy token agreement
   with the unquantized model (the primary measure here, clearly labelled as such) and, where
   the evaluation package is present, the DriveLM scores of both against the ground truth.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from ..bag.io import QUERY_TOPIC, camera_topic, read_bag
from ..cameras import CAMERAS
from ..engines.bound_stages import bound_engines
from ..engines.bundle import MANIFEST, read_manifest, write_manifest
from ..engines.cuda_graph import StaticStage
from ..engines.onnxruntime_engine import Bundle
from ..engines.stages import DecoderStage, DraftStage, HeadStage, PrefillStage, VisionStage
from ..errors import InputError, LiteVLMError
from ..evaluation.data import frame_images, load_frames
from ..evaluation.metrics import ACCURACY, Question, derive_tags, score
from ..pipeline.pipeline import Pipeline
from ..serving.images import payload_from_msg, to_pipeline_image
from ..weights.integrity import sha256_file
from .exporter import export_bundle

PRECISIONS = ("int8", "fp8", "int4")
METHODS = ("entropy", "max")
# Stages quantized from recorded traffic. The LM head stays in the export's precision, as
# ModelOpt's LLM PTQ configurations leave `lm_head` unquantized (greedy decoding reads its argmax
# directly); graphs of stages the PyTorch pipeline runs itself (EAGLE draft, view selector) are
# carried over unchanged.
QUANTIZED_STAGES = ("vision", "prefill", "decoder", "decoder_batch")
MAX_SAMPLE_BYTES = 1 << 30          # per graph: a decoder sample carries the whole KV cache


# ------------------------------------------------------------------------------------- traffic
@dataclass
class Query:
    images: dict          # camera -> bytes / path / RGB array
    question: str
    reference: str = ""   # ground-truth answer when the source has one
    id: str = ""


def queries_from_qa(path: Path, frames_root: Path | None = None) -> list[Query]:
    """Every question of a DriveLM v1.1 file with its frame's six images (frame order, then the
    file's question order)."""

    root = Path(frames_root) if frames_root else Path(path).parent
    out = []
    for frame in load_frames(path):
        images = {cam: p.read_bytes() for cam, p in frame_images(root, frame).items()}
        out += [Query(images, q.question, q.answer, q.id) for q in frame.questions]
    return out


def queries_from_bag(path: Path, camera_topics: dict[str, str] | None = None) -> list[Query]:
    """Each query of a rosbag2 (litevlm_msgs/Query on /litevlm/query, or std_msgs/String
    questions) with the newest frame of every camera at that moment, read with the bag tooling
    of litevlm_runtime.bag.io."""

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
            text = getattr(msg, "text", None) or getattr(msg, "data", "")
            if all(c in latest for c in CAMERAS) and text.strip():
                out.append(Query(dict(latest), text, id=getattr(msg, "id", "") or f"q{len(out)}"))
    if not out:
        raise InputError(f"{path}: no query with all six cameras before it")
    return out


def load_queries(data: Path, frames_root: Path | None = None) -> list[Query]:
    data = Path(data)
    if data.suffix == ".json":
        return queries_from_qa(data, frames_root)
    if data.is_dir() or data.suffix in (".mcap", ".db3"):
        return queries_from_bag(data)
    raise InputError(f"--data {data}: expected a DriveLM QA .json or a rosbag2 (folder, .mcap or .db3)")


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
            pipe.answer(q.images, q.question)
        except InputError as exc:
            progress(f"  skipped {q.id}: {exc}")
            continue
        progress(f"[{label} {i + 1}/{len(queries)}] {q.question[:60]}")


# ------------------------------------------------------------------------------------- quantize
class SamplesReader:
    """The calibration-reader interface ModelOpt calls (onnxruntime's CalibrationDataReader plus
    ModelOpt's get_first) over recorded samples, one graph call each."""

    def __init__(self, samples: list[dict[str, np.ndarray]]):
        self.samples = samples
        self.rewind()

    def get_next(self):
        return next(self._it, None)

    def get_first(self):
        return self.samples[0]

    def rewind(self):
        self._it = iter(self.samples)


QUANTIZED_OPS = ("MatMul", "Gemm", "Conv")


def weight_nodes(path: Path, only: set[str] | None = None, keep_float: str = "") -> list[str]:
    """MatMul/Gemm/Conv nodes with a weight (initializer) operand, as anchored name patterns
    (`only`: those whose weight is one of these initializers; `keep_float`: a regular expression,
    products whose weight's name it matches (re.search) are left out: a mixed configuration).

    Only these are quantized: activation x activation products (attention scores over the KV
    cache, probabilities x values) are left in full precision, because their calibrated ranges
    come from caches that are mostly masked-out or empty at calibration time and INT8 there
    ruins the decoder (measured: prefill hidden states off by 75% relative with them, see the
    calibration tests)."""

    import onnx

    model = onnx.load(str(path), load_external_data=False)
    weights = {t.name for t in model.graph.initializer}
    # Weights may also reach a MatMul through a Transpose/Cast of an initializer or a Constant.
    origin = {w: w for w in weights} | {o: o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    for n in model.graph.node:
        if n.op_type in ("Transpose", "Cast", "Identity", "Reshape") and n.input and n.input[0] in origin:
            origin.update({o: origin[n.input[0]] for o in n.output})
    skip = re.compile(keep_float) if keep_float else None
    return [f"^{re.escape(n.name)}$" for n in model.graph.node
            if n.op_type in QUANTIZED_OPS and any(i in origin and (only is None or origin[i] in only)
                                                  and not (skip and skip.search(origin[i])) for i in n.input)]


def quantize_graph(src: Path, dst: Path, precision: str, samples: list[dict[str, np.ndarray]],
                   method: str = "entropy", export_dtype: str = "float32", weights_file: str | None = None,
                   only: set[str] | None = None, keep_float: str = "", fp8_decode: bool = False) -> None:
    """`only`: quantize just the products of these weights (the batched step: those quantized in
    the single decode step), whatever their shape; `keep_float`: see weight_nodes; `fp8_decode`:
    FP8 also where a product has one row (see _quantize)."""
    try:
        from modelopt.onnx.quantization import quantize
    except ImportError as exc:
        raise LiteVLMError(f"NVIDIA ModelOpt's ONNX quantization is not importable ({exc}); "
                           f"pip install nvidia-modelopt onnx-graphsurgeon lief (see requirements.txt)") from None

    own = [src.parent / weights_file] if weights_file else list(src.parent.glob("*.weights"))
    model_bytes = src.stat().st_size + sum(f.stat().st_size for f in own)
    # ModelOpt and onnxruntime's calibrator print a histogram progress bar per tensor; our own
    # progress line per graph replaces them, and their output is shown if quantization fails.
    chatter = io.StringIO()
    # ModelOpt may rewrite its input graph in place (shape inference, opset updates): quantize a
    # copy in a scratch folder so that the source bundle keeps matching its manifest.

    try:
        with tempfile.TemporaryDirectory(dir=dst.parent) as scratch, \
                contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            work = Path(scratch) / src.name
            shutil.copy2(src, work)
            for weights in own:
                shutil.copy2(weights, Path(scratch) / weights.name)
            _quantize(quantize, work, dst, precision, samples, method, model_bytes, export_dtype, only, keep_float,
                      fp8_decode)
    except Exception as exc:
        raise LiteVLMError(
            f"{src.name}: ModelOpt {precision} quantization failed: {exc}\n{chatter.getvalue()[-2000:]}"
        ) from exc
    if not dst.is_file():
        raise LiteVLMError(f"{src.name}: ModelOpt wrote no quantized graph")


def _quantize(quantize, src, dst, precision, samples, method, model_bytes, export_dtype, only=None, keep_float="",
              fp8_decode=False):
    nodes = weight_nodes(src, only, keep_float)
    if not nodes:
        raise LiteVLMError(f"{Path(src).name}: no weight product left to quantize")
    quantize(
        str(src),
        quantize_mode=precision,
        calibration_data_reader=SamplesReader(samples),
        nodes_to_quantize=nodes,
        calibration_method=method,
        calibration_eps=["cpu"],
        high_precision_dtype={"float16": "fp16", "bfloat16": "bf16"}.get(export_dtype, "fp32"),
        output_path=str(dst),
        log_level="ERROR",
        use_external_data_format=model_bytes > (1 << 31) - (1 << 28),
        # ModelOpt skips GEMV-shaped products (a decode step's T=1 rows) because TensorRT
        # runs them no faster in INT8; on the CPU they are the memory-bound part INT8 helps.
        # FP8 keeps ModelOpt's default (the one-row step `decoder_1` stays float, as TensorRT
        # builds it from such a bundle) unless `fp8_decode`: then its products are FP8 too, what
        # TensorRT runs if the step is built with FP8 GEMMs (and what the accuracy of an FP8
        # decode measures). `only` (the batched step) never needs it: its products are named.
        enable_gemv_detection_for_trt=(precision == "fp8" and only is None and not fp8_decode),
    )


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


def onnx_graph(path: Path):
    import onnx

    return onnx.load(str(path), load_external_data=False).graph


def activation_scales(graph) -> dict[str, list[str]]:
    """Per quantized weight product of a Q/DQ graph: weight initializer -> the (scale, zero point)
    initializers of the QuantizeLinear on its activation input."""
    made_by = {o: n for n in graph.node for o in n.output}
    weights = {t.name for t in graph.initializer}
    found = {}
    for n in graph.node:
        if n.op_type not in QUANTIZED_OPS:
            continue
        # QuantizeLinear / DequantizeLinear, or TensorRT's FP8 forms (TRT_FP8QuantizeLinear ...)
        quantized = [
            made_by.get(made_by[i].input[0])
            if i in made_by and made_by[i].op_type.endswith("DequantizeLinear")
            else None
            for i in n.input[:2]
        ]
        if any(q is None or not q.op_type.endswith("QuantizeLinear") for q in quantized):
            continue
        weight = [q for q in quantized if q.input[0] in weights]
        activation = [q for q in quantized if q.input[0] not in weights]
        if len(weight) == 1 and len(activation) == 1:
            found[weight[0].input[0]] = list(activation[0].input[1:3])
    return found


def share_activation_scales(source: Path, target: Path) -> int:
    """The batched step quantized with the single decode step's activation scales, product by
    product (matched by weight): each row of a batch is then quantized exactly as the same
    query's step alone, so batching changes no rounding (its own calibration on the same rows
    gave other scales, and greedy answers that differed from the one-at-a-time ones). Weight
    scales are per channel from the weights, the same in both already. Returns how many."""
    import onnx
    from onnx import numpy_helper

    src = onnx_graph(source)
    dst = onnx.load(str(target), load_external_data=False)
    values = {t.name: t for t in src.initializer}
    theirs, ours = activation_scales(src), activation_scales(dst.graph)
    if set(theirs) != set(ours):
        raise LiteVLMError(f"{target.name}: quantized products differ from {source.name}'s "
                           f"({sorted(set(theirs) ^ set(ours))[:4]})")
    by_name = {t.name: t for t in dst.graph.initializer}
    for weight, names in ours.items():
        for name, src_name in zip(names, theirs[weight]):
            by_name[name].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(values[src_name]), name))
    onnx.save(dst, str(target))
    return len(ours)


def quantize_batched_step(src_bundle: Path, out: Path, graph: dict, step: dict, manifest: dict, recorder: Recorder,
                          precision: str, method: str) -> tuple[list, str] | None:
    """The batched step quantized as the single decode step `step` (already quantized in `out`)
    is: the same products (by weight), then the same activation scales, so that each row of a
    batch rounds as the same query's step alone. Returns (samples, source), or None when the
    step has no quantized product (the batched step then stays as exported: what the step
    computes)."""
    only = set(activation_scales(onnx_graph(out / step["file"])))
    if not only:
        return None
    samples, source = batched_samples(graph, manifest, recorder)
    quantize_graph(src_bundle / graph["file"], out / graph["file"], precision, samples, method, manifest["dtype"],
                   graph.get("weights"), only)
    shared = share_activation_scales(out / step["file"], out / graph["file"])
    return samples, f"{source}; activation scales of {step['file']} ({shared} products)"


def quantize_bundle(src_bundle: Path, out: Path, precision: str, recorder: Recorder, calibration_info: dict,
                    progress=print) -> dict:
    """A new bundle in `out`: every graph quantized from its samples; manifest updated."""
    import modelopt

    manifest = read_manifest(src_bundle)
    out.mkdir(parents=True, exist_ok=True)
    graphs = []
    weights = {}
    for i, g in enumerate(manifest["graphs"]):
        t0 = time.perf_counter()

        def keep(why: str = "", label: str = manifest["dtype"]) -> None:
            shutil.copy2(src_bundle / g["file"], out / g["file"])
            shutil.copy2(src_bundle / g["weights"], out / g["weights"])
            weights[g["weights"]] = sha256_file(out / g["weights"])
            graphs.append(dict(g, precision=label))
            progress(f"[quantize {i + 1}/{len(manifest['graphs'])}] {g['file']:<18} kept in {manifest['dtype']}{why}")

        stages, keep_float = (
            calibration_info.get("quantized_stages", QUANTIZED_STAGES),
            calibration_info.get("keep_float", ""),
        )
        if g["stage"] not in QUANTIZED_STAGES or g["stage"] not in stages:
            keep("" if g["stage"] not in QUANTIZED_STAGES else " (not in --stages)")
            continue
        if not weight_nodes(src_bundle / g["file"], None, keep_float):
            keep(f" (--keep-float {keep_float!r} leaves no product to quantize)")
            continue
        if g["stage"] == "decoder_batch":
            step = next(s for s in graphs if s["stage"] == "decoder" and s["bucket"] == 1)
            if step.get("precision") == manifest["dtype"]:
                keep(f" (as {step['file']}: kept float)")
                continue
            done = quantize_batched_step(src_bundle, out, g, step, manifest, recorder, precision,
                                         calibration_info["method"])
            if done is None:          # FP8: ModelOpt leaves a 1-row step's GEMV-shaped products to TensorRT
                keep(f" (as {step['file']}: no product quantized there)", precision)
                continue
            samples, source = done
        else:
            samples, source = samples_for(g, manifest, recorder)
            quantize_graph(src_bundle / g["file"], out / g["file"], precision, samples, calibration_info["method"],
                           manifest["dtype"], g.get("weights"), keep_float=keep_float,
                           fp8_decode=calibration_info.get("fp8_decode", False))
        entry = dict(g, sha256=sha256_file(out / g["file"]), calibration_samples=len(samples), precision=precision,
                     calibration_source=source, calibration_calls=recorder.calls.get(g["file"], 0))
        entry.pop("weights", None)
        graphs.append(entry)
        progress(f"[quantize {i + 1}/{len(manifest['graphs'])}] {g['file']:<18} {precision}  {len(samples)} samples "
                 f"({source}; {entry['calibration_calls']} calls)  {time.perf_counter() - t0:5.1f} s")
    for f in out.glob("*.onnx.data"):           # external data ModelOpt wrote for big graphs
        weights[f.name] = sha256_file(f)
    manifest.update(graphs=graphs, weights=weights, precision=precision, engines={},
                    calibration=dict(calibration_info, modelopt=modelopt.__version__, source_bundle=str(src_bundle)))
    write_manifest(out, manifest)
    return manifest


# ------------------------------------------------------------------------------------- accuracy
@dataclass
class AccuracyReport:
    questions: int = 0
    identical_answers: int = 0
    token_agreement: float = 0.0            # matching tokens / reference tokens, position by position
    reference_tokens: int = 0
    drivelm: dict = field(default_factory=dict)

    def lines(self, precision: str) -> list[str]:
        out = [f"evaluation on {self.questions} held-out questions (quantized vs unquantized fp32 model, both "
               f"through ONNX Runtime):",
               f"  token agreement with the fp32 model: {self.token_agreement:.4f} "
               f"({self.reference_tokens} fp32 answer tokens, greedy, position by position)",
               f"  answers identical to the fp32 model's: {self.identical_answers}/{self.questions}"]
        if self.drivelm:
            for name, v in self.drivelm.items():
                out.append(f"  DriveLM {name}: fp32 {v['fp32']}  {precision} {v[precision]}  delta {v['delta']}")
        return out


def token_agreement(ref: list[int], got: list[int]) -> int:
    return sum(a == b for a, b in zip(ref, got))


def drivelm_accuracy(queries: list[Query], answers: dict[str, list[str]]) -> dict:
    """DriveLM accuracy (exact match on its multiple-choice / yes-no questions) of each set of
    answers, scored by litevlm_runtime.evaluation; {} when no held-out question is of that kind."""
    picked = [(i, q) for i, q in enumerate(queries) if ACCURACY in derive_tags(q.question, q.reference)]
    if not picked:
        return {}
    qs = [Question(q.id, q.id, q.question, q.reference, (ACCURACY,), "calibration") for _, q in picked]
    return {name: (score(qs, {q.id: texts[i] for (i, _), q in zip(picked, qs)}).accuracy, len(qs))
            for name, texts in answers.items()}


def evaluate(model_dir: Path, options, fp32_bundle: Path, quant_bundle: Path, precision: str,
             queries: list[Query], progress=print) -> AccuracyReport:


    report = AccuracyReport(questions=0)
    if not queries:
        return report
    on_ort = lambda b: replace(options, backend=replace(options.backend, name="onnxruntime", bundle=str(b)))
    ref = Pipeline.from_pretrained(model_dir, on_ort(fp32_bundle))
    quant = Pipeline.from_pretrained(model_dir, on_ort(quant_bundle))
    texts = {"fp32": [], precision: []}
    agree = 0
    for i, q in enumerate(queries):
        a, b = ref.answer(q.images, q.question), quant.answer(q.images, q.question)
        texts["fp32"].append(a.text)
        texts[precision].append(b.text)
        agree += token_agreement(a.token_ids, b.token_ids)
        report.reference_tokens += len(a.token_ids)
        report.identical_answers += int(a.token_ids == b.token_ids)
        report.questions += 1
        progress(f"[evaluate {i + 1}/{len(queries)}] {'same' if a.token_ids == b.token_ids else 'differs'}  "
                 f"{q.question[:50]}")
    report.token_agreement = agree / max(1, report.reference_tokens)
    if all(q.reference for q in queries):
        acc = drivelm_accuracy(queries, texts)
        if acc:
            (a32, n), (aq, _) = acc["fp32"], acc[precision]
            report.drivelm = {f"accuracy ({n} multiple-choice/yes-no questions)": {
                "fp32": f"{a32:.4f}", precision: f"{aq:.4f}", "delta": f"{aq - a32:+.4f}"}}
    return report


def int4_bundle(rt, bundle: Path, manifest: dict, recorder: Recorder, quant_dir: Path, quantized: Path | None,
                progress=print, keep_float: str = "") -> dict:
    """The INT4 bundle: `quantized` (the project's stored weights) written into the graphs; without
    it, ModelOpt's INT4 AWQ-lite of the prompt graph that saw the most traffic (its weights then serve
    every decoder graph, and the LM head, which that graph does not hold, is quantized round to
    nearest by the project's quantizer, symmetric), stored under `quant_dir`-weights first."""
    from ..weights.quantize import load_quantized, quantize_int4, save_quantized
    from .int4_onnx import modelopt_int4_weights, write_int4_bundle

    if quantized is None:
        prompts = [g for g in manifest["graphs"] if g["stage"] == "prefill" and recorder.samples.get(g["file"])]
        if not prompts:
            raise LiteVLMError("calibration traffic never reached a prefill graph: answer more questions")
        graph = max(prompts, key=lambda g: len(recorder.samples[g["file"]]))
        quantized = quant_dir.with_name(quant_dir.name + "-weights")
        progress(
            f"ModelOpt INT4 AWQ-lite of {graph['file']} ({len(recorder.samples[graph['file']])} calls) -> {quantized}"
        )
        made = modelopt_int4_weights(bundle / graph["file"], rt, recorder.samples[graph["file"]], quantized)
        _, weights = load_quantized(quantized)
        head = next(n for n, m in rt.model.named_modules() if m is rt.lm.head)
        weights[head] = quantize_int4(rt.lm.head.weight, made["group_size"], symmetric=True)
        made.pop("modules"), made.pop("files"), made.pop("format")
        save_quantized(quantized, weights, dict(made, module_info={head: {"method": "rtn (the LM head)"}}))
    return write_int4_bundle(rt, bundle, quantized, quant_dir, progress, keep_float=keep_float)


def mix_bundles(base: Path, donor: Path, stages: tuple[str, ...], out: Path) -> dict:
    """A bundle in `out`: `base`'s graphs, with those of `stages` taken from `donor` (both made from
    the same export: e.g. an FP8 bundle with the float export's vision graphs, to measure what FP8
    vision costs on its own). The manifest says which graph came from where."""
    a, b = read_manifest(base), read_manifest(donor)
    if a["model"].get("checkpoint_sha256") != b["model"].get("checkpoint_sha256") or a["arena"] != b["arena"]:
        raise LiteVLMError(f"{base} and {donor} were not exported from the same checkpoint and arena")
    theirs = {(g["stage"], g["bucket"]): g for g in b["graphs"]}
    out.mkdir(parents=True, exist_ok=True)
    graphs, weights = [], {}
    for g in a["graphs"]:
        src, entry = (donor, theirs[(g["stage"], g["bucket"])]) if g["stage"] in stages else (base, g)
        shutil.copy2(src / entry["file"], out / entry["file"])
        files = [entry["weights"]] if entry.get("weights") else []
        files += [f.name for f in src.glob(entry["file"] + ".data")]
        for f in files:
            shutil.copy2(src / f, out / f)
            weights[f] = sha256_file(out / f)
        graphs.append(dict(entry, source=str(src)))
    precisions = sorted({g.get("precision") or a["dtype"] for g in graphs})
    manifest = dict(a, graphs=graphs, weights=weights, engines={}, precision="+".join(precisions),
                    mixed={"base": str(base), "donor": str(donor), "stages": list(stages)})
    write_manifest(out, manifest)
    return manifest


# ------------------------------------------------------------------------------------- Q/DQ check
def check_bundle(model_dir: Path, data: Path, quant_bundle: Path, options, frames_root: Path | None = None,
                 questions: int = 4, samples_per_graph: int = 2, reference: bool = True, seed: int = 1,
                 progress=print) -> list:
    """Every quantized graph of `quant_bundle` checked as export/qdq.py describes, on inputs recorded
    from `questions` questions of `data` (drawn with `seed`, answered by the PyTorch pipeline on the
    bundle's buckets, as calibration records them): each Q/DQ pair against the float8/int8/int4
    rounding recomputed in numpy, the graph against onnx's reference evaluator and against the
    unquantized graph of the bundle it was calibrated from."""

    from .qdq import check_graph

    quant_bundle = Path(quant_bundle)
    manifest = read_manifest(quant_bundle)
    if not manifest.get("precision"):
        raise LiteVLMError(f"{quant_bundle}: not a quantized bundle (no precision in its manifest)")
    made = manifest.get("calibration") or manifest.get("quantization") or {}
    if "source_bundle" not in made:
        raise LiteVLMError(f"{quant_bundle}: its manifest does not say which float bundle it was made from")
    src_dir = Path(made["source_bundle"])
    pipe = Pipeline.from_pretrained(model_dir, replace(options, backend=replace(options.backend, name="torch")))
    src = Bundle(pipe.rt, src_dir)
    queries = load_queries(data, frames_root)
    picked, _ = split_queries(queries, questions, 0, seed)
    recorder = Recorder(samples_per_graph, seed)
    collect_traffic(pipe, src, picked, recorder, progress)
    reports = []
    for g in manifest["graphs"]:
        if g.get("precision") in (None, manifest["dtype"]) or g["stage"] not in QUANTIZED_STAGES:
            continue
        feeds, _ = samples_for(g, src.manifest, recorder)
        t0 = time.perf_counter()
        reports.append(check_graph(quant_bundle / g["file"], feeds[:samples_per_graph], src_dir / g["file"],
                                   reference=reference))
        r = reports[-1]
        progress(f"[check {len(reports)}] {g['file']:<18} {r.checked} pairs, {r.mismatches}/{r.elements} elements "
                 f"differ, ORT vs reference {r.vs_reference:.1e}, vs float {r.vs_float:.1e}  "
                 f"{time.perf_counter() - t0:.1f} s")
    return reports


# ------------------------------------------------------------------------------------- top level
def calibrate(model_dir: Path, data: Path, precision: str, out: Path, options, bundle: Path | None = None,
              buckets=None, frames_root: Path | None = None, calib_questions: int = 16, eval_questions: int = 16,
              samples_per_graph: int = 16, method: str | None = None, progress=print,
              stages: tuple[str, ...] = QUANTIZED_STAGES, keep_float: str = "", name: str = "",
              quantized: Path | None = None, fp8_decode: bool = False) -> tuple[dict, AccuracyReport]:
    """`stages`: which of QUANTIZED_STAGES to quantize (the others stay as exported); `keep_float`: a
    regular expression of weight names whose products stay float (a mixed configuration, e.g. the
    layers the sensitivity report ranks first); `name`: the bundle's folder under `out` (default:
    the precision). int4: the decoder's weights stored by `litevlm quantize --symmetric` in
    `quantized` written into the graphs (export/int4_onnx.py), or without it ModelOpt's INT4 AWQ
    from the recorded traffic (`int4_bundle`). `fp8_decode` (fp8 only): the one-row decode step
    `decoder_1` (and with it the batched step) in FP8 too; ModelOpt leaves GEMV-shaped products
    float by default."""

    if precision not in PRECISIONS:
        raise LiteVLMError(f"--precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if fp8_decode and precision != "fp8":
        raise InputError(f"--fp8-decode is for --precision fp8 ({precision} quantizes the one-row step already)")
    out = Path(out)
    queries = load_queries(data, frames_root)
    calib, held_out = split_queries(queries, calib_questions, eval_questions)
    progress(
        f"{len(queries)} questions in {data}: {len(calib)} for calibration, {len(held_out)} held out for evaluation"
    )
    pipe = Pipeline.from_pretrained(model_dir, replace(options, backend=replace(options.backend, name="torch")))
    if bundle is None:
        bundle = out / "fp32"
        if not (bundle / MANIFEST).is_file():
            progress(f"no --bundle: exporting the unquantized graphs to {bundle}")
            export_bundle(pipe.rt, bundle, buckets, progress=progress)
    src = Bundle(pipe.rt, bundle)
    if src.manifest.get("precision"):
        raise LiteVLMError(f"{bundle}: already quantized ({src.manifest['precision']}); calibrate an fp32 export")
    recorder = Recorder(samples_per_graph)
    if not (precision == "int4" and quantized):          # stored INT4 weights need no traffic
        t0 = time.perf_counter()
        collect_traffic(pipe, src, calib, recorder, progress)
        progress(f"traffic recorded in {time.perf_counter() - t0:.1f} s")
    unknown = sorted(set(stages) - set(QUANTIZED_STAGES))
    if unknown:
        raise InputError(f"--stages {','.join(unknown)}: not one of {', '.join(QUANTIZED_STAGES)}")
    quant_dir = out / (name or precision)
    if quant_dir.exists():
        shutil.rmtree(quant_dir)
    if precision == "int4":
        manifest = int4_bundle(pipe.rt, Path(bundle), src.manifest, recorder, quant_dir, quantized, progress,
                               keep_float=keep_float)
    else:
        method = method or ("max" if precision == "fp8" else "entropy")
        if method not in METHODS:
            raise LiteVLMError(f"calibration method {method!r}: one of {', '.join(METHODS)}")
        info = {"data": str(data), "questions": len(calib), "samples_per_graph": samples_per_graph, "method": method,
                "quantized_stages": list(stages), "keep_float": keep_float}
        if fp8_decode:
            info["fp8_decode"] = True
        manifest = quantize_bundle(Path(bundle), quant_dir, precision, recorder, info, progress)
    # FP8 Q/DQ runs in ONNX Runtime too (its CPU QuantizeLinear/DequantizeLinear take float8e4m3fn;
    # `calibrate --check` proves every pair): every precision is measured against the float graphs.
    report = evaluate(model_dir, options, Path(bundle), quant_dir, precision, held_out, progress)
    manifest.setdefault("calibration", {})["evaluation"] = report.__dict__
    write_manifest(quant_dir, manifest)
    (out / f"calibration_report_{quant_dir.name}.json").write_text(json.dumps(
        {"precision": precision, "bundle": str(quant_dir), "fp32_bundle": str(bundle),
         "evaluation": report.__dict__}, indent=2) + "\n")
    return manifest, report
