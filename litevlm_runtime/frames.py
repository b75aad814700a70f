"""Finding a six-camera frame set on disk: a folder of CAM_X.jpg/png files, or a folder of CAM_X/
sub-folders (nuScenes `samples/` layout) from which the N-th frame of each camera is taken."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .cameras import CAMERAS
from .errors import InputError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def frame_set(folder: str | Path, index: int = 0, cameras=CAMERAS) -> dict[str, Path]:
    folder = Path(folder)
    if (folder / "samples").is_dir() and not any((folder / c).exists() for c in cameras):
        folder = folder / "samples"
    found: dict[str, Path] = {}
    for cam in cameras:
        flat = [folder / f"{cam}{s}" for s in IMAGE_SUFFIXES if (folder / f"{cam}{s}").is_file()]
        if flat:
            found[cam] = flat[0]
            continue
        sub = folder / cam
        files = sorted(p for p in sub.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if sub.is_dir() else []
        if not files:
            raise InputError(f"{folder}: no image for {cam} (expected {cam}.jpg or {cam}/*.jpg)")
        if index >= len(files):
            raise InputError(f"{sub}: frame index {index} out of range ({len(files)} frames)")
        found[cam] = files[index]
    return found


def read_frame_set(folder: str | Path, index: int = 0) -> dict[str, bytes]:
    return {cam: path.read_bytes() for cam, path in frame_set(folder, index).items()}


def load_frame_sets(frames: Path | None, count: int) -> list[dict]:
    """Up to `count` frame sets of a folder (at least its first), or `count` sets of random 800x450
    frames when no folder is given (what `litevlm bench` measures without data)."""
    if frames is None:
        rng = np.random.default_rng(0)
        return [{c: rng.integers(0, 256, (450, 800, 3), dtype=np.uint8) for c in CAMERAS} for _ in range(count)]
    sets = []
    for i in range(count):
        try:
            sets.append(read_frame_set(frames, i))
        except InputError:
            break
    return sets or [read_frame_set(frames, 0)]
