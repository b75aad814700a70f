"""The learning-rate schedule: linear warm-up, then cosine decay to a floor, by step or by the
fraction of a time budget spent."""

from __future__ import annotations

import math


def cosine_decay(progress: float, peak: float, floor: float) -> float:
    """From peak at progress 0 to floor * peak at progress 1."""
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def learning_rate(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to floor * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return cosine_decay((step - warmup) / max(1, total - warmup), peak, floor)


def learning_rate_at(fraction: float, peak: float, warmup: float, floor: float = 0.1) -> float:
    """The same schedule over the fraction of a time budget spent (`--time-budget`): linear warm-up
    over the first `warmup` of it, then cosine decay to floor * peak."""
    fraction = min(max(fraction, 0.0), 1.0)
    if fraction < warmup:
        return peak * max(fraction / warmup, 1e-3)
    return cosine_decay((fraction - warmup) / max(1e-9, 1 - warmup), peak, floor)
