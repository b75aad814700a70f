"""LiteVLM runtime: a low-latency six-camera vision-language pipeline (InternVL2.5 family)."""

__version__ = "0.1.0"
