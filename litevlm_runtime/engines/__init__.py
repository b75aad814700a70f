"""Stage engines: one small interface the pipeline drives, one module per backend."""

from ..options import BackendName
from .base import DecoderEngine, DraftEngine, Engines, HeadEngine, StageEngine, VisionEngine
from .compiled import compiled_engines
from .cuda_graph import cuda_graph_engines
from .onnxruntime_engine import onnxruntime_engines
from .tensorrt_engine import tensorrt_engines
from .torch_engine import torch_engines

__all__ = ["DecoderEngine", "DraftEngine", "Engines", "HeadEngine", "StageEngine", "VisionEngine",
           "torch_engines", "make_engines"]


def make_engines(rt) -> Engines:
    """The engines of the runtime's backend (options.backend.name) over its model and arena.
    Backends beyond torch import their runtime (onnxruntime, TensorRT, CUDA) only when chosen."""
    name = rt.options.backend.name
    if name == BackendName.TORCH:
        return torch_engines(rt)
    if name == BackendName.ONNXRUNTIME:
        return onnxruntime_engines(rt)
    if name == BackendName.TORCH_COMPILE:
        return compiled_engines(rt)
    if name == BackendName.TENSORRT:
        return tensorrt_engines(rt)
    return cuda_graph_engines(rt)
