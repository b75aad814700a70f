"""Stage engines: one small interface the pipeline drives, one module per backend."""

from pathlib import Path

from ..options import BUNDLE_BACKENDS, BackendName
from .base import BatchDecoderEngine, DecoderEngine, DraftEngine, Engines, HeadEngine, StageEngine, VisionEngine
from .buckets import batch_sizes
from .bundle import graphs_of, read_manifest
from .compiled import compiled_engines
from .cuda_graph import cuda_graph_engines
from .onnxruntime_engine import onnxruntime_engines
from .openvino_engine import openvino_engines
from .tensorrt_engine import tensorrt_engines
from .torch_engine import torch_engines

__all__ = ["BatchDecoderEngine", "DecoderEngine", "DraftEngine", "Engines", "HeadEngine", "StageEngine",
           "VisionEngine", "torch_engines", "make_engines", "batch_limit"]


def make_engines(rt) -> Engines:
    """The engines of the runtime's backend (options.backend.name) over its model and arena.
    Backends beyond torch import their runtime (onnxruntime, OpenVINO, TensorRT, CUDA) only when chosen."""
    name = rt.options.backend.name
    if name == BackendName.TORCH:
        return torch_engines(rt)
    if name == BackendName.ONNXRUNTIME:
        return onnxruntime_engines(rt)
    if name == BackendName.OPENVINO:
        return openvino_engines(rt)
    if name == BackendName.TORCH_COMPILE:
        return compiled_engines(rt)
    if name == BackendName.TENSORRT:
        return tensorrt_engines(rt)
    return cuda_graph_engines(rt)


def batch_limit(options) -> tuple[int, str]:
    """Queries the chosen backend decodes together: (serving.max_batch, "") where it batches,
    else (1, why). Every backend batches (torch eager, torch-compile and torch-cudagraph per
    batch bucket, a bundle's batched step graph); not with FastV (its per-layer masks are one
    query's), nor from a bundle without a batched step graph (exported before it existed), nor
    a TensorRT bundle whose engines lack it, nor a calibrated bundle whose batched step kept
    another precision than its decoder (its answers would differ from the one-at-a-time ones).
    A max_batch above what the bundle's graph was exported for is an error naming both."""
    want = options.serving.max_batch
    if want <= 1:
        return 1, ""
    if options.fastv.ratio > 0:
        return 1, "FastV (fastv.ratio > 0) prunes with per-layer masks of one query"
    name = options.backend.name
    if name not in BUNDLE_BACKENDS:
        return want, ""
    if not options.backend.bundle:
        return 1, f"backend {name.value} has no backend.bundle"
    bundle = Path(options.backend.bundle)
    manifest = read_manifest(bundle)
    graph = next(iter(graphs_of(manifest, "decoder_batch").values()), None)
    if graph is None:
        return 1, (f"the bundle {bundle} has no batched decode step graph (exported before it was built): "
                   f"re-export it (litevlm export) to batch")
    steps = {g.get("precision", manifest["dtype"]) for g in manifest["graphs"] if g["stage"] == "decoder"}
    if steps != {graph.get("precision", manifest["dtype"])}:
        return 1, (f"the bundle {bundle}'s batched step is {graph.get('precision', manifest['dtype'])}, its decode "
                   f"steps {', '.join(sorted(steps))} (calibration quantizes only what single queries run)")
    if name == BackendName.TENSORRT:
        record = manifest.get("engines", {}).get(options.backend.precision, {})
        if graph["file"] not in record.get("files", {}):
            return 1, (f"the bundle {bundle}'s {options.backend.precision} TensorRT engines have no batched step "
                       f"(built before it existed): run `litevlm build-engines {bundle}` again to batch")
    batch_sizes(tuple(graph["buckets"]), want, f"the bundle {bundle}")       # refuses more than it was exported for
    return want, ""
