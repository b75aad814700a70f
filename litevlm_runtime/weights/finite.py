"""Every floating tensor a load reads must be finite: a NaN or an infinity in a weight (a flipped
exponent bit in a folder without a manifest, an overflowed fp16 export, a diverged training run)
answers `ok` with garbage instead of failing. Checked once per tensor as it is read, before any
weight is used; the refusal names the file and the tensor.

Cost: one float32 sum per tensor. safetensors maps the files lazily, so a load alone reads almost
nothing and the check is what first pages the weights in (warm-up or the first query would);
`python -m litevlm_runtime.bench.finite_cost DIR` prints load, load + one read of every page, load + check.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import CheckpointError


def check_finite(source: str | Path, name: str, t: torch.Tensor) -> None:
    """CheckpointError naming `source` and the tensor when a floating tensor holds NaN or inf."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    # NaN and inf propagate through a sum (+inf with -inf gives NaN), so a finite sum proves every
    # element finite: one reduction, 17x faster than isfinite().all() here (50 vs 846 ms per 256 MB).
    # A non-finite sum of finite values (overflow) is ruled out by the exact check.
    if math.isfinite(float(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all()):
        return
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    first = tuple(int(i) for i in torch.nonzero(~torch.isfinite(t))[0])
    raise CheckpointError(f"{source}: tensor {name!r} is not finite ({nan} NaN, {inf} inf of {t.numel()} values; "
                          f"first at index {first}): refused (a corrupt or diverged weight)")
