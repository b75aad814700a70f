"""Finding a six-camera frame set on disk: a folder of CAM_X.jpg/png files, or a folder of CAM_X/
sub-folders (nuScenes `samples/` layout) from which the N-th frame of each camera is taken."""

from __future__ import annotations

from pathlib import Path

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
