"""LiteVLM runtime: a low-latency six-camera vision-language pipeline (InternVL2.5 family)."""

from .threads import apply_wait_policy

# Before anything imports torch: its OpenMP runtime reads the wait policy once, when it loads
# (threads.py says why passive). The console entry points import this package first.
apply_wait_policy()

__version__ = "0.1.0"
