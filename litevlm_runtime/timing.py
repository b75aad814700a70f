"""Per-stage timing: a monotonic clock on the CPU, CUDA events on a GPU (no host sync per stage)."""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager

import torch


class StageTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object, object]] = []

    @contextmanager
    def __call__(self, stage: str, idle: bool = False):
        """Time the block as `stage`; `idle`: the stage is skipped by design this time (a follow-up's
        vision: its block runs a few bookkeeping calls) and is reported as 0 ms."""
        if idle:
            yield
            self._marks.append((stage, None, None))
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._marks.append((stage, start, end))

    def mark(self):
        """Now, as `record` takes it (a recorded CUDA event on a GPU): for a stage that is not one
        block of code (a query's decode steps interleaved with other queries' in a batch)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def record(self, stage: str, start, end) -> None:
        """A stage from two `mark`s."""
        self._marks.append((stage, start, end))

    def milliseconds(self) -> dict[str, float]:
        """Per stage, in the order first timed; a stage timed in several blocks (a K-frame query's
        preprocess and vision, one frame set's tiles per call) is their sum."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for s, a, b in self._marks:
            ms = 0.0 if a is None else a.elapsed_time(b) if self.cuda else (b - a) * 1000.0
            out[s] = out.get(s, 0.0) + ms
        return out


def median_ms(fn, repeats: int, device: torch.device) -> float:
    """Median wall milliseconds of `fn()` over `repeats` calls after one untimed call, synchronising
    the device after each (warm-up cost tables: budget.py, spec_policy.py)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def percentile(values, q: float) -> float:
    """The q-th percentile (q in percent, 0..100) with linear interpolation between the closest
    ranks (numpy's default); nan for no values. The one percentile of the package: latency
    tables, /diagnostics, the soak and contention harnesses all use it."""
    s = sorted(float(v) for v in values)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
