"""Stage engines: one small interface the pipeline drives, one module per backend."""

from .base import Engines, StageEngine
from .torch_engine import torch_engines

__all__ = ["Engines", "StageEngine", "torch_engines", "make_engines"]


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
