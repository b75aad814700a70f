"""Quantization of an export bundle's graphs from their recorded samples, with NVIDIA ModelOpt.

Each graph is quantized by `modelopt.onnx.quantization.quantize` from its own samples
(traffic.py): INT8 or FP8 Q/DQ, both of which ONNX Runtime's CPU kernels execute as written (FP8:
QuantizeLinear/DequantizeLinear to float8e4m3fn, opset 19+; `--check` proves it pair by pair,
check.py and export/qdq.py), and TensorRT builds its engines from. Only weight products are
quantized (`weight_nodes`). The batched step is quantized as the single decode step is, with that
step's activation scales (`quantize_batched_step`). INT4: weight-only, the project's stored
weights (or ModelOpt's AWQ) written as blocked DequantizeLinear (`int4_bundle`,
export/int4_onnx.py). Graph inputs and outputs keep their dtypes, so the new bundle binds exactly
like the original one.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ...engines.bundle import read_manifest, write_manifest
from ...errors import LiteVLMError
from ...weights.integrity import sha256_file
from ..int4_onnx import write_int4_bundle
from .plan import QUANTIZED_STAGES, CalibrationPlan
from .traffic import Recorder, batched_samples, samples_for

QUANTIZED_OPS = ("MatMul", "Gemm", "Conv")


@dataclass(frozen=True)
class GraphQuantization:
    """How each graph of a bundle is quantized (the same for all of them)."""
    precision: str                  # int8 | fp8 (Q/DQ)
    method: str = "entropy"         # activation ranges: entropy | max (plan.METHODS)
    export_dtype: str = "float32"   # the graphs' float type (the manifest's dtype): what stays unquantized
    keep_float: str = ""            # a regular expression: weight products whose names it matches stay float
    fp8_decode: bool = False        # fp8: GEMV-shaped (one-row) products in FP8 too (see _quantize)

    @classmethod
    def of(cls, plan: CalibrationPlan, export_dtype: str) -> GraphQuantization:
        return cls(plan.precision, plan.method, export_dtype, plan.keep_float, plan.fp8_decode)


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



def weight_nodes(path: Path, only: set[str] | None = None, keep_float: str = "") -> list[str]:
    """MatMul/Gemm/Conv nodes with a weight (initializer) operand, as anchored name patterns
    (`only`: those whose weight is one of these initializers; `keep_float`: a regular expression,
    products whose weight's name it matches (re.search) are left out: a mixed configuration).

    Only these are quantized: activation x activation products (attention scores over the KV
    cache, probabilities x values) are left in full precision, because their calibrated ranges
    come from caches that are mostly masked-out or empty at calibration time and INT8 there
    ruins the decoder (measured: prefill hidden states off by 75% relative with them, see the
    calibration tests)."""

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


def quantize_graph(src: Path, dst: Path, samples: list[dict[str, np.ndarray]], how: GraphQuantization,
                   weights_file: str | None = None, only: set[str] | None = None) -> None:
    """`src` quantized as `how` says into `dst`, calibrated on `samples`. `only`: quantize just the
    products of these weights (the batched step: those quantized in the single decode step),
    whatever their shape."""
    try:
        # (ModelOpt is imported where a graph is quantized: it is heavy, and only calibration needs it)
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
            _quantize(quantize, work, dst, samples, how, model_bytes, only)
    except Exception as exc:
        raise LiteVLMError(
            f"{src.name}: ModelOpt {how.precision} quantization failed: {exc}\n{chatter.getvalue()[-2000:]}"
        ) from exc
    if not dst.is_file():
        raise LiteVLMError(f"{src.name}: ModelOpt wrote no quantized graph")


def _quantize(quantize, src: Path, dst: Path, samples: list, how: GraphQuantization, model_bytes: int,
              only: set[str] | None = None) -> None:
    nodes = weight_nodes(src, only, how.keep_float)
    if not nodes:
        raise LiteVLMError(f"{Path(src).name}: no weight product left to quantize")
    quantize(
        str(src),
        quantize_mode=how.precision,
        calibration_data_reader=SamplesReader(samples),
        nodes_to_quantize=nodes,
        calibration_method=how.method,
        calibration_eps=["cpu"],
        high_precision_dtype={"float16": "fp16", "bfloat16": "bf16"}.get(how.export_dtype, "fp32"),
        output_path=str(dst),
        log_level="ERROR",
        use_external_data_format=model_bytes > (1 << 31) - (1 << 28),
        # ModelOpt skips GEMV-shaped products (a decode step's T=1 rows) because TensorRT
        # runs them no faster in INT8; on the CPU they are the memory-bound part INT8 helps.
        # FP8 keeps ModelOpt's default (the one-row step `decoder_1` stays float, as TensorRT
        # builds it from such a bundle) unless `fp8_decode`: then its products are FP8 too, what
        # TensorRT runs if the step is built with FP8 GEMMs (and what the accuracy of an FP8
        # decode measures). `only` (the batched step) never needs it: its products are named.
        enable_gemv_detection_for_trt=(how.precision == "fp8" and only is None and not how.fp8_decode),
    )


def onnx_graph(path: Path):
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
                          how: GraphQuantization) -> tuple[list, str] | None:
    """The batched step quantized as the single decode step `step` (already quantized in `out`)
    is: the same products (by weight), then the same activation scales, so that each row of a
    batch rounds as the same query's step alone. Returns (samples, source), or None when the
    step has no quantized product (the batched step then stays as exported: what the step
    computes)."""
    only = set(activation_scales(onnx_graph(out / step["file"])))
    if not only:
        return None
    samples, source = batched_samples(graph, manifest, recorder)
    quantize_graph(src_bundle / graph["file"], out / graph["file"], samples, how, graph.get("weights"), only)
    shared = share_activation_scales(out / step["file"], out / graph["file"])
    return samples, f"{source}; activation scales of {step['file']} ({shared} products)"


def quantize_bundle(plan: CalibrationPlan, recorder: Recorder, record: dict, progress=print) -> dict:
    """plan.quant_dir: every graph of plan.source_bundle in plan.stages quantized from its samples,
    the others copied; the manifest updated, its "calibration" entry `record` (what was done)."""
    # (ModelOpt is imported where it runs: heavy, and only calibration needs it)
    import modelopt

    src_bundle, out = plan.source_bundle, plan.quant_dir
    manifest = read_manifest(src_bundle)
    how = GraphQuantization.of(plan, manifest["dtype"])
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

        if g["stage"] not in QUANTIZED_STAGES or g["stage"] not in plan.stages:
            keep("" if g["stage"] not in QUANTIZED_STAGES else " (not in --stages)")
            continue
        if not weight_nodes(src_bundle / g["file"], None, how.keep_float):
            keep(f" (--keep-float {how.keep_float!r} leaves no product to quantize)")
            continue
        if g["stage"] == "decoder_batch":
            step = next(s for s in graphs if s["stage"] == "decoder" and s["bucket"] == 1)
            if step.get("precision") == manifest["dtype"]:
                keep(f" (as {step['file']}: kept float)")
                continue
            done = quantize_batched_step(src_bundle, out, g, step, manifest, recorder, how)
            if done is None:          # FP8: ModelOpt leaves a 1-row step's GEMV-shaped products to TensorRT
                keep(f" (as {step['file']}: no product quantized there)", how.precision)
                continue
            samples, source = done
        else:
            samples, source = samples_for(g, manifest, recorder)
            quantize_graph(src_bundle / g["file"], out / g["file"], samples, how, g.get("weights"))
        entry = dict(g, sha256=sha256_file(out / g["file"]), calibration_samples=len(samples),
                     precision=how.precision, calibration_source=source,
                     calibration_calls=recorder.calls.get(g["file"], 0))
        entry.pop("weights", None)
        graphs.append(entry)
        progress(f"[quantize {i + 1}/{len(manifest['graphs'])}] {g['file']:<18} {how.precision}  {len(samples)} "
                 f"samples ({source}; {entry['calibration_calls']} calls)  {time.perf_counter() - t0:5.1f} s")
    for f in out.glob("*.onnx.data"):           # external data ModelOpt wrote for big graphs
        weights[f.name] = sha256_file(f)
    manifest.update(graphs=graphs, weights=weights, precision=how.precision, engines={},
                    calibration=dict(record, modelopt=modelopt.__version__, source_bundle=str(src_bundle)))
    write_manifest(out, manifest)
    return manifest


def int4_bundle(plan: CalibrationPlan, rt, progress=print) -> dict:
    """The INT4 bundle in plan.quant_dir: plan.quantized (the project's stored weights; export/awq.py
    `with_int4_weights` makes them when the user names none) written into the graphs."""
    bundle, quant_dir, quantized = plan.source_bundle, plan.quant_dir, plan.quantized
    if quantized is None:
        raise LiteVLMError("INT4 calibration writes stored weights into the graphs: the plan names none (--quantized, "
                           "or export.awq.with_int4_weights)")
    return write_int4_bundle(rt, bundle, quantized, quant_dir, progress, keep_float=plan.keep_float)
