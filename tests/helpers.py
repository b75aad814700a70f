"""Small builders shared by tests: checkpoints in the real layout and synthetic frame sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from litevlm_runtime.cameras import CAMERAS


def make_tiny_checkpoint(path: Path, preset: str = "tiny", seed: int = 0, **kw) -> Path:
    from litevlm_runtime.commands.make_checkpoint import make_checkpoint

    if not (path / "config.json").is_file():
        make_checkpoint(path, preset, seed=seed, **kw)
    return path


def random_frames(seed: int = 0, h: int = 90, w: int = 160) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam in CAMERAS}


def options(**settings):
    """PipelineOptions from settings, `__` for the dots of their names:
    options(max_new_tokens=4, tokens__mode="layer0", tokens__keep_ratio=0.5)."""
    from litevlm_runtime.options import options_from_flat

    return options_from_flat({k.replace("__", "."): v for k, v in settings.items()})
