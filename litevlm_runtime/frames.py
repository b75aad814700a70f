"""Finding six-camera frame sets on disk.

One frame set: a folder of CAM_X.jpg/png files, or a folder of CAM_X/ sub-folders (nuScenes
`samples/` layout) from which the N-th frame of each camera is taken (`frame_set`).

Frame sets over time: nuScenes names every camera file `<log>__<CAM_X>__<capture time>.jpg`, the
capture time in microseconds (16 digits), and SynthDrive in motion names its files the same way
(`<scene>__CAM_X__<time>.jpg`). From those names, `sequences` lists a folder's frame sets per
scene in time order, and `frames_over_time` finds, for a key frame's six files, the frame sets
of the same scene `stride` seconds apart before it: what a K-frame question is answered from
(docs/motion.md). Each camera is matched on its own capture times (nuScenes' cameras fire some
tens of milliseconds apart), to the nearest file within `tolerance`.
"""

from __future__ import annotations

import bisect
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cameras import CAMERAS
from .errors import InputError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
CAPTURE_US = re.compile(r"__(\d{16})\.(jpg|jpeg|png)$", re.IGNORECASE)
TOLERANCE_OF_STRIDE = 0.25        # default tolerance: a quarter of the stride (0.125 s at nuScenes' 2 Hz)


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


# -- frame sets over time -------------------------------------------------------------------------

def capture_us(path: str | Path) -> int | None:
    """The capture time (microseconds) in a nuScenes-style file name, or None."""
    m = CAPTURE_US.search(Path(path).name)
    return int(m.group(1)) if m else None


def scene_of(path: str | Path) -> str:
    """The scene a stamped file belongs to: its name before the first "__" (nuScenes' log name)."""
    return Path(path).name.split("__")[0]


@dataclass(frozen=True)
class TimedFrameSet:
    """One frame set of a sequence: a file and its capture time per camera."""
    offset_s: float                  # against the key frame: 0, -stride, -2 stride, ... (measured with stride None)
    stamps_us: dict[str, int | None]     # None: a single frame set of files named without a capture time
    paths: dict[str, Path]

    @property
    def stamp_us(self) -> int | None:
        """The set's time: its latest camera's (a frame store matches a set by its newest frame)."""
        known = [t for t in self.stamps_us.values() if t is not None]
        return max(known) if len(known) == len(self.stamps_us) else None


@functools.lru_cache(maxsize=64)
def _stamped_files(folder: str, mtime_ns: int) -> dict[str, list[tuple[int, Path]]]:
    """scene -> [(capture time, path)] in time order, of the stamped images in one camera folder
    (cached per folder and modification time: a nuScenes samples/CAM_X folder holds 34,000 files)."""
    out: dict[str, list[tuple[int, Path]]] = {}
    with os.scandir(folder) as entries:
        for entry in entries:
            stamp = capture_us(entry.name)
            if stamp is not None and entry.is_file():
                out.setdefault(scene_of(entry.name), []).append((stamp, Path(entry.path)))
    for files in out.values():
        files.sort(key=lambda item: item[0])
    return out


def _scene_files(path: Path) -> list[tuple[int, Path]]:
    folder = path.parent
    return _stamped_files(str(folder), folder.stat().st_mtime_ns).get(scene_of(path), [])


def frames_over_time(key: dict[str, str | Path], frames: int, stride_s: float | None = 0.5,
                     tolerance_s: float | None = None, cameras=CAMERAS) -> list[TimedFrameSet]:
    """The `frames` frame sets a K-frame question is answered from, oldest first, the key frame
    (`key`: camera -> its file) last. Each camera's earlier files are those of the same scene in
    the same folder, matched by the capture times in their names: the file nearest the key
    file's time minus j x stride_s (j = 1 .. frames - 1), within tolerance_s (default a quarter of
    the stride). stride_s None: the scene's frames just before the key frame, whatever their
    spacing (the DriveLM sample's key frames are seconds apart); offset_s is then measured, of the
    first camera. An InputError names the camera and the time step that has no frame."""
    if frames < 1:
        raise InputError(f"frames {frames}: a question uses at least the key frame set")
    if stride_s is not None and stride_s <= 0:
        raise InputError(f"stride {stride_s:g} s: expected a positive number of seconds")
    tolerance_us = round(1e6 * (tolerance_s if tolerance_s is not None else TOLERANCE_OF_STRIDE * (stride_s or 0)))
    missing = [cam for cam in cameras if cam not in key]
    if missing:
        raise InputError(f"key frame set has no {', '.join(missing)}")
    stamps: list[dict[str, int | None]] = [{} for _ in range(frames)]      # newest (the key) first here
    paths: list[dict[str, Path]] = [{} for _ in range(frames)]
    for cam in cameras:
        path = Path(key[cam])
        key_us = capture_us(path)
        if key_us is None:
            if frames == 1:
                stamps[0][cam], paths[0][cam] = None, path
                continue
            raise InputError(f"{cam}: {path.name} has no capture time in its name (<scene>__{cam}__<16-digit "
                             f"microseconds>.jpg, as nuScenes and `litevlm synth --frames K` name files), so "
                             f"no earlier frame can be found for it")
        files = _scene_files(path) if frames > 1 else []
        times = [t for t, _ in files]
        before = files[:bisect.bisect_left(times, key_us)]
        stamps[0][cam], paths[0][cam] = key_us, path
        for j in range(1, frames):
            if stride_s is None:
                if j > len(before):
                    raise InputError(f"{cam}: no frame at time step t-{j} (the {j}. frame set before the key "
                                     f"frame {path.name}): scene {scene_of(path)} has {len(before)} earlier "
                                     f"frame(s) in {path.parent}")
                t, p = before[-j]
            else:
                want = key_us - round(j * stride_s * 1e6)
                i = bisect.bisect_left(times, want, hi=len(before))
                near = [before[k] for k in (i - 1, i) if 0 <= k < len(before)]
                t, p = min(near, key=lambda item: abs(item[0] - want)) if near else (None, None)
                if t is None or abs(t - want) > tolerance_us:
                    nearest = "it has none earlier" if t is None else f"its nearest is at {(t - key_us) / 1e6:+.3f} s"
                    raise InputError(f"{cam}: no frame at time step t-{j} ({-j * stride_s:+g} s = {j} x stride "
                                     f"{stride_s:g} s before the key frame {path.name}, within {tolerance_us / 1e6:g}"
                                     f" s): scene {scene_of(path)} in {path.parent}, {nearest}")
            stamps[j][cam], paths[j][cam] = t, p
    first = cameras[0]
    sets = []
    for j in reversed(range(frames)):
        offset = -j * stride_s if stride_s is not None else (stamps[j][first] - stamps[0][first]) / 1e6
        sets.append(TimedFrameSet(offset, stamps[j], paths[j]))
    return sets


def sequences(folder: str | Path, cameras=CAMERAS) -> dict[str, list[TimedFrameSet]]:
    """Every scene's frame sets in a samples/CAM_X/ folder of stamped files, in time order, keyed by
    scene (file-name prefix); offset_s is against the scene's last set. The i-th files of the six
    cameras in time order make the i-th set; a scene whose cameras hold different numbers of files
    is refused, naming them."""
    folder = Path(folder)
    samples = folder / "samples" if (folder / "samples").is_dir() else folder
    per_cam = {}
    for cam in cameras:
        sub = samples / cam
        if not sub.is_dir():
            raise InputError(f"{samples}: no {cam}/ folder")
        per_cam[cam] = _stamped_files(str(sub), sub.stat().st_mtime_ns)
    out = {}
    for scene in sorted({s for files in per_cam.values() for s in files}):
        counts = {cam: len(per_cam[cam].get(scene, [])) for cam in cameras}
        if len(set(counts.values())) != 1:
            raise InputError(f"{samples}: scene {scene!r} has different frame counts per camera: "
                             + ", ".join(f"{c} {n}" for c, n in counts.items()))
        n = counts[cameras[0]]
        last = per_cam[cameras[0]][scene][-1][0]
        out[scene] = [TimedFrameSet((per_cam[cameras[0]][scene][i][0] - last) / 1e6,
                                    {c: per_cam[c][scene][i][0] for c in cameras},
                                    {c: per_cam[c][scene][i][1] for c in cameras}) for i in range(n)]
    return out
