"""Making bags from DriveLM-layout folders (real nuScenes frames + DriveLM QA, or SynthDrive
rendered in the same layout): six camera streams at their capture times and each key frame's
questions asked shortly after its frame set.

Sequences: a scene's frame sets go into the bag in stamp order at their capture times (nuScenes'
and SynthDrive-in-motion's file names carry them, frames.py), so a bag of a SynthDrive set made
with `--frames K --stride S` holds each key frame's K - 1 earlier frame sets S apart before it:
replayed into the node, the frame store has the history a K-frame question needs. In a scene with
QA, only its key frames (the frames with QA) are asked questions; the frame sets before them are
history. Scenes are `scene_gap_s` apart, longer than a question's history window, so no history
reaches into the scene before. `query_frames` K writes Query.frames K into every question (0, the
default: the node's temporal.frames decides, as `litevlm eval --set temporal.frames=K` does)."""

from __future__ import annotations

import io
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..cameras import CAMERAS
from ..errors import InputError
from ..evaluation.data import load_frames
from ..frames import capture_us, scene_of
from ..pipeline.request import QueryRequest
from ..serving.images import raw_encoding as check_encoding
from .io import BagContents, CameraFrame, raw_frame

# PIL is imported where a frame is encoded (encode_png): the rest of bag making needs no image library.

# Questions for frames that come without DriveLM QA (the sample's n015 scene).
GENERIC_QUESTIONS = (
    "What are the important objects in the current scene?",
    "What should the ego vehicle do next?",
)


def _downscale(data: bytes, max_width: int | None) -> bytes:
    if not max_width:
        return data
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    if img.width <= max_width:
        return data
    img = img.convert("RGB").resize((max_width, round(img.height * max_width / img.width)), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _drivelm_questions(qa_files: Iterable[Path]) -> dict[str, list[str]]:
    """CAM_FRONT image file name -> that key frame's questions (read by evaluation.data, the one
    DriveLM reader), interleaving the categories (perception, prediction, planning, behavior) so
    the first few cover all of them. JSON files that are not DriveLM QA (SynthDrive's
    ground_truth.json, synthdrive.json) are skipped."""
    by_frame: dict[str, list[str]] = {}
    for qa_file in qa_files:
        try:
            frames = load_frames(qa_file)
        except InputError:
            continue
        for frame in frames:
            if "CAM_FRONT" not in frame.image_paths:
                continue
            by_category: dict[str, list[str]] = {}
            for q in frame.questions:
                by_category.setdefault(q.category, []).append(q.question)
            cats = list(by_category.values())
            by_frame[Path(frame.image_paths["CAM_FRONT"]).name] = [q for group in _zip_longest(cats) for q in group]
    return by_frame


def _zip_longest(lists):
    for i in range(max((len(x) for x in lists), default=0)):
        yield [x[i] for x in lists if i < len(x)]


def _scene_frames(samples: Path) -> dict[str, dict[str, list[tuple[int | None, Path]]]]:
    """The images under samples/CAM_X/: scene -> camera -> [(capture time in ns or None, path)],
    in file-name order (a defaultdict: a camera without frames in a scene reads as [])."""
    scenes: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for cam in CAMERAS:
        for path in sorted((samples / cam).iterdir()):
            if path.suffix.lower() not in (".jpg", ".jpeg", ".png"):
                continue
            stamp_us = capture_us(path)
            # nuScenes: the log name before "__" is the scene; rendered frames have no capture
            # time and all go on one synthetic timeline, in file-name order.
            scene = scene_of(path) if stamp_us is not None else "~synthetic"
            scenes[scene][cam].append((stamp_us * 1000 if stamp_us is not None else None, path))
    return scenes


@dataclass(frozen=True)
class BagTiming:
    """Where a made bag puts its questions and scenes on its timeline."""
    query_delay_s: float = 0.2          # a frame set's first question, after the set
    query_spacing_s: float = 0.15       # its next questions, each after the one before
    scene_gap_s: float = 2.0            # between one scene's last message and the next scene
    synthetic_period_s: float = 0.5     # between frames without a capture time (rendered data)


def drivelm_contents(folder: Path, max_frames: int | None = None, questions_per_frame: int = 2,
                     max_width: int | None = None, timing: BagTiming = BagTiming(),
                     raw_encoding: str | None = None, query_frames: int = 0) -> BagContents:
    """Key frames of a DriveLM-layout folder (samples/CAM_X/*.jpg + QA json files) as six
    camera streams at their capture times, with that frame's DriveLM questions asked
    `timing.query_delay_s` after the frame set (then every `query_spacing_s`).

    Capture times come from the nuScenes file names (trailing 16-digit microseconds); files
    without one (rendered data) are put on a `synthetic_period_s` timeline. Scenes (file-name
    prefix before "__") follow each other with `scene_gap_s` between them."""

    if raw_encoding:
        check_encoding(raw_encoding)
    if not 0 <= query_frames <= 255:
        raise InputError(f"--query-frames {query_frames}: 0 (the node's temporal.frames) to 255 (Query.frames)")
    folder = Path(folder)
    samples = folder / "samples" if (folder / "samples").is_dir() else folder
    if not all((samples / c).is_dir() for c in CAMERAS):
        raise InputError(f"{folder}: expected samples/CAM_X/ folders for {', '.join(CAMERAS)}")
    questions = _drivelm_questions(sorted(folder.glob("*.json")))
    scenes = _scene_frames(samples)
    contents = BagContents()
    cursor_ns = None          # where the next scene starts on the bag's timeline
    n_sets = 0
    def has_qa(scene):
        return any(path.name in questions for _, path in scenes[scene]["CAM_FRONT"])

    # Scenes with DriveLM QA first (so that --max-frames keeps real questions), then by time.
    for scene in sorted(scenes, key=lambda s: (not has_qa(s), min((t or 0) for c in scenes[s].values() for t, _ in c))):
        per_cam = {c: sorted(scenes[scene][c], key=lambda x: (x[0] or 0, x[1].name)) for c in CAMERAS}
        counts = {len(v) for v in per_cam.values()}
        if len(counts) != 1:
            raise InputError(f"{folder}: scene {scene!r} has different frame counts per camera: "
                             + ", ".join(f"{c} {len(v)}" for c, v in per_cam.items()))
        n = counts.pop()
        with_qa = has_qa(scene)         # then only its key frames are asked; the sets between are history
        first = min((t for v in per_cam.values() for t, _ in v if t is not None), default=None)
        base = 1_700_000_000 * 10**9 if cursor_ns is None else cursor_ns
        shift = 0 if (cursor_ns is None and first is not None) else (base - (first or 0))
        last_ns = (first + shift) if first is not None else base
        for k in range(n):
            if max_frames is not None and n_sets >= max_frames:
                break
            stamps = {}
            for cam in CAMERAS:
                t, path = per_cam[cam][k]
                t = (t + shift) if t is not None else base + int(k * timing.synthetic_period_s * 1e9)
                stamps[cam] = t
                original = path.read_bytes()
                data = _downscale(original, max_width)
                if raw_encoding:
                    contents.frames[cam].append(raw_frame(t, data, raw_encoding, name=str(path)))
                else:
                    fmt = "jpeg" if (data is not original or path.suffix.lower() != ".png") else "png"
                    contents.frames[cam].append(CameraFrame(t, data, fmt))
            set_ns = max(stamps.values())
            front = per_cam["CAM_FRONT"][k][1].name
            qs = questions.get(front, []) if with_qa else list(GENERIC_QUESTIONS)
            for j, text in enumerate(qs[:questions_per_frame]):
                t = set_ns + int((timing.query_delay_s + j * timing.query_spacing_s) * 1e9)
                contents.queries.append(QueryRequest(text, stamp_ns=t, query_id=f"f{n_sets}q{j}", frames=query_frames))
                last_ns = max(last_ns, t)
            last_ns = max(last_ns, set_ns)
            n_sets += 1
        cursor_ns = last_ns + int(timing.scene_gap_s * 1e9)
    if n_sets == 0:
        raise InputError(f"{folder}: no frames found")
    return contents
