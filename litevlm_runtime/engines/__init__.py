"""Stage engines: one small interface the pipeline drives, one module per backend."""

from .base import Engines, StageEngine
from .torch_engine import torch_engines

__all__ = ["Engines", "StageEngine", "torch_engines", "make_engines"]


def _register_backends() -> None:
    """Backends beyond torch import their runtime (onnxruntime, TensorRT, CUDA) only when chosen."""
    from .base import BACKENDS

    def onnxruntime(pipeline):
        from .onnxruntime_engine import onnxruntime_engines
        return onnxruntime_engines(pipeline)

    def tensorrt(pipeline):
        from .tensorrt_engine import tensorrt_engines
        return tensorrt_engines(pipeline)

    def torch_cuda_graph(pipeline):
        from .cuda_graph import cuda_graph_engines
        return cuda_graph_engines(pipeline)

    BACKENDS.setdefault("onnxruntime", onnxruntime)
    BACKENDS.setdefault("tensorrt", tensorrt)
    BACKENDS.setdefault("torch-cudagraph", torch_cuda_graph)


_register_backends()


def make_engines(pipeline, backend: str) -> Engines:
    """The engines of `backend` for `pipeline`'s model and arena ("torch" here; other backends
    register in BACKENDS)."""
    from .base import BACKENDS

    if backend == "torch":
        return torch_engines(pipeline)
    if backend not in BACKENDS:
        from ..errors import LiteVLMError

        raise LiteVLMError(f"unknown backend {backend!r}; available: torch, {', '.join(BACKENDS) or '-'}")
    return BACKENDS[backend](pipeline)
