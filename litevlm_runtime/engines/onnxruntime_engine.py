"""ONNX Runtime engines: the exported stage graphs (see export.py), one session per bucket, with
every input and output bound once, at start-up, to fixed torch buffers through io_binding.

Which tensor is bound to which arena buffer is shared with TensorRT and CUDA graphs (see
bound_stages.py); here each bucket's runner is an InferenceSession plus its IOBinding over the
torch tensors' memory, so ORT reads and writes the same addresses on every call and a run
allocates nothing in torch.

Execution providers: CPU here; on a CUDA device the CUDA provider (TensorRT's provider first
when ONNX Runtime has it), binding device memory the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import LiteVLMError
from ..export.exporter import check_bundle_matches, graphs_of, read_manifest, verify_files
from .base import Engines
from .bound_stages import bound_engines

ELEMENT_TYPES = {torch.float32: "float32", torch.float16: "float16", torch.int64: "int64", torch.bool: "bool"}


def import_onnxruntime():
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


class BoundGraph:
    """One bucket's session with its inputs/outputs bound to fixed tensors."""

    def __init__(self, path: Path, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor],
                 device: torch.device, threads: int | None = None):
        import numpy as np

        ort = import_onnxruntime()
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        # ORT's worker threads spin after each run by default; between graph runs the pipeline
        # does its own work on the same cores (preprocessing, embedding lookups, sampling).
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(path), opts, providers=providers_for(device))
        self.binding = self.session.io_binding()
        device_type = "cuda" if device.type == "cuda" else "cpu"
        names_in = [i.name for i in self.session.get_inputs()]
        names_out = [o.name for o in self.session.get_outputs()]
        if sorted(names_in) != sorted(inputs) or sorted(names_out) != sorted(outputs):
            raise LiteVLMError(f"{path.name}: graph has {names_in} -> {names_out}, engine binds "
                               f"{list(inputs)} -> {list(outputs)}")
        self.tensors = {**inputs, **outputs}   # keep the bound memory alive with the binding
        for kind, tensors in (("input", inputs), ("output", outputs)):
            for name, t in tensors.items():
                if not t.is_contiguous():
                    raise LiteVLMError(f"{path.name}: {name} must be bound to contiguous memory")
                if t.dtype not in ELEMENT_TYPES:
                    raise LiteVLMError(f"backend onnxruntime: {t.dtype} is not supported (float32 or float16)")
                bind = self.binding.bind_input if kind == "input" else self.binding.bind_output
                bind(name, device_type, device.index or 0, np.dtype(ELEMENT_TYPES[t.dtype]), tuple(t.shape),
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

    def bind(stage, bucket, inputs, outputs):
        return BoundGraph(bundle.dir / bundle.graphs(stage)[bucket]["file"], inputs, outputs, rt.device, threads)

    return bound_engines(rt, bundle.sizes(), bind, "onnxruntime")
