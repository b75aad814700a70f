"""ONNX Runtime engines: the exported stage graphs (see export.py), one session per graph file, with
every input and output bound once, at start-up, to fixed torch buffers through io_binding.

Which tensor is bound to which arena buffer is shared with TensorRT and CUDA graphs (see
bound_stages.py); here each bucket's runner is an IOBinding over the torch tensors' memory on
its graph's InferenceSession, so ORT reads and writes the same addresses on every call and a run
allocates nothing in torch. A session is opened once per graph file and shared by its bindings:
the step graphs bound again over each KV region of a batch (BoundDecoder.on_region), and the
batched step's one graph (a dynamic batch dimension) bound once per batch bucket, hold their
weights once.

Execution providers: CPU here; on a CUDA device the CUDA provider (TensorRT's provider first
when ONNX Runtime has it), binding device memory the same way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import LiteVLMError
from .base import Engines
from .bound_stages import bound_engines
from .buckets import batch_sizes
from .bundle import check_bundle_matches, graphs_of, read_manifest, verify_files

# (int8 / uint8: a quantized KV cache's codes, arena.kv_dtype int8 / fp8; float16: their scales)
ELEMENT_TYPES = {torch.float32: "float32", torch.float16: "float16", torch.int64: "int64", torch.bool: "bool",
                 torch.int8: "int8", torch.uint8: "uint8"}


def import_onnxruntime():
    """ONNX Runtime, an optional backend: imported where a backend asks for it, so that its absence is
    a clear error naming the package, not an import failure of the engines."""
    try:
        import onnxruntime
    except ImportError:
        raise LiteVLMError("backend onnxruntime: onnxruntime is not installed (pip install onnxruntime)") from None
    return onnxruntime


def providers_for(device: torch.device) -> list:
    ort = import_onnxruntime()
    available = ort.get_available_providers()
    if device.type == "cuda":
        wanted = ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
        chosen = [p for p in wanted if p in available]
        if not chosen:
            raise LiteVLMError(f"backend onnxruntime on {device}: this onnxruntime has no CUDA provider "
                               f"(available: {', '.join(available)}); install onnxruntime-gpu or run on cpu")
        return [(p, {"device_id": device.index or 0}) for p in chosen]
    return ["CPUExecutionProvider"]


def session_options(threads: int | None = None):
    """The session options of every graph the backend runs (and of the Q/DQ checks: export/qdq.py)."""
    ort = import_onnxruntime()
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
    # ORT's worker threads spin after each run by default; between graph runs the pipeline
    # does its own work on the same cores (preprocessing, embedding lookups, sampling).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # A blocked-int4 DequantizeLinear -> MatMul is fused into MatMulNBits, which by default (level 4)
    # also rounds the *activations* to int8 (measured: 4e-3 relative error against the float64
    # product of the dequantized weights, 3.5e-7 at level 1). TensorRT's INT4 AWQ is weight-only
    # (activations stay 16-bit): level 1 (float32 activations) computes what the graph says.
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return opts


def open_session(path: Path, device: torch.device, threads: int | None = None):
    ort = import_onnxruntime()
    return ort.InferenceSession(str(path), session_options(threads), providers=providers_for(device))


class BoundGraph:
    """One bucket of a graph: its session with the inputs/outputs bound to fixed tensors."""

    def __init__(self, session, name: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor],
                 device: torch.device):
        self.session = session
        self.binding = self.session.io_binding()
        device_type = "cuda" if device.type == "cuda" else "cpu"
        names_in = [i.name for i in self.session.get_inputs()]
        names_out = [o.name for o in self.session.get_outputs()]
        if sorted(names_in) != sorted(inputs) or sorted(names_out) != sorted(outputs):
            raise LiteVLMError(f"{name}: graph has {names_in} -> {names_out}, engine binds "
                               f"{list(inputs)} -> {list(outputs)}")
        self.tensors = {**inputs, **outputs}   # keep the bound memory alive with the binding
        for kind, tensors in (("input", inputs), ("output", outputs)):
            for tensor_name, t in tensors.items():
                if not t.is_contiguous():
                    raise LiteVLMError(f"{name}: {tensor_name} must be bound to contiguous memory")
                if t.dtype not in ELEMENT_TYPES:
                    raise LiteVLMError(f"backend onnxruntime: a {t.dtype} tensor ({tensor_name}) is not supported "
                                       f"(float32, float16, int64, bool, int8, uint8)")
                bind = self.binding.bind_input if kind == "input" else self.binding.bind_output
                bind(tensor_name, device_type, device.index or 0, np.dtype(ELEMENT_TYPES[t.dtype]), tuple(t.shape),
                     t.data_ptr())

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)


class Bundle:
    """An export (or calibration) bundle checked against the runtime it is loaded into."""

    def __init__(self, rt, bundle: Path):
        self.dir = Path(bundle)
        self.manifest = read_manifest(self.dir)
        check_bundle_matches(self.manifest, rt, self.dir)
        verify_files(self.manifest, self.dir)

    def graphs(self, stage: str) -> dict[int, dict]:
        g = graphs_of(self.manifest, stage)
        if not g:
            raise LiteVLMError(f"{self.dir}: no {stage} graphs in the bundle")
        return g

    def sizes(self) -> dict[str, tuple[int, ...]]:
        sizes = {stage: tuple(sorted(self.graphs(stage))) for stage in ("vision", "prefill", "decoder", "head")}
        sizes["eagle_draft"] = tuple(sorted(graphs_of(self.manifest, "eagle_draft")))
        return sizes

    def batch_graph(self) -> dict | None:
        """The batched decode step's graph (one, with a dynamic batch dimension; its `buckets`
        are the batch sizes it was exported and checked for), or None in a bundle without it."""
        return next(iter(graphs_of(self.manifest, "decoder_batch").values()), None)

    def batch_sizes(self, capacity: int) -> tuple[int, ...]:
        """The batch buckets a runtime of `capacity` KV regions binds the batched graph at; () in
        a bundle without one (runtime.batch_capacity gives such a runtime one region)."""
        g = self.batch_graph()
        return batch_sizes(tuple(g["buckets"]) if g else (), capacity, f"the bundle {self.dir}")

    def graph_file(self, stage: str, bucket: int) -> str:
        if stage == "decoder_batch":
            g = self.batch_graph()
            assert g is not None and bucket <= max(g["buckets"])
            return g["file"]
        return self.graphs(stage)[bucket]["file"]


def bundle_path(rt) -> Path:
    bundle = rt.options.backend.bundle
    if not bundle:
        raise LiteVLMError(f"backend.name {rt.options.backend.name.value}: no backend.bundle given (an export "
                           f"folder: `litevlm export --model MODEL --out DIR`)")
    return Path(bundle)


def onnxruntime_engines(rt) -> Engines:
    import_onnxruntime()
    if rt.dtype not in (torch.float32, torch.float16):
        raise LiteVLMError(f"backend onnxruntime: dtype {rt.options.dtype} is not supported (float32 or float16)")
    bundle = Bundle(rt, bundle_path(rt))
    threads = rt.options.threads()
    sessions: dict[str, object] = {}

    def bind(stage, bucket, inputs, outputs):
        file = bundle.graph_file(stage, bucket)
        if file not in sessions:
            sessions[file] = open_session(bundle.dir / file, rt.device, threads)
        return BoundGraph(sessions[file], file, inputs, outputs, rt.device)

    sizes = bundle.sizes()
    sizes["decoder_batch"] = bundle.batch_sizes(rt.arena.limits.batch)
    return bound_engines(rt, sizes, bind, "onnxruntime")
