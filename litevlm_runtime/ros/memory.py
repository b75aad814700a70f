"""Giving a dropped model's memory back to the system (lifecycle cleanup).

Dropping the last reference frees the tensors, but glibc keeps freed heap memory in its arenas
and the pages stay resident. In one process on one thread, loading, warming up and dropping the
bundled pipeline 6 times kept RSS flat (~298 MB) with no Pipeline/Runtime/model object left (gc
count); in the node it grew, likely because the worker thread, new per activate, allocates from
an arena of its own (a guess, not measured apart). Measured on the
bundled model over DDS, 8 deactivate/cleanup/configure/activate cycles: RSS 512 -> 676 MB (+32%)
without a trim; with it, 20 cycles 516 -> 527 MB (+2.1%) (tests/ros/test_ros_memory.py).
malloc_trim(0) returns the free pages of every arena.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from pathlib import Path


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def release_memory() -> str:
    """Collect cycles (a model's modules refer to each other), then trim glibc's arenas; returns
    'before -> after MB' for the log ('' parts where /proc or glibc is not there)."""
    before = rss_mb()
    gc.collect()
    libc = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(libc).malloc_trim(0)
    except (OSError, AttributeError, TypeError):     # not glibc (musl, macOS): nothing to trim
        pass
    return f"{before:.0f} -> {rss_mb():.0f} MB"
