"""The one DriveLM reader: DriveLM v1.1 QA files (real DriveLM or SynthDrive) into key frames,
their questions and their six image files. Evaluation, every trainer, calibration and `bag make`
read DriveLM data through it, so a question is numbered and an image path resolved one way.

Two optional additions to DriveLM's layout carry time (docs/motion.md): a key frame's
"timestamp" (microseconds, as nuScenes' sample; else read from its CAM_FRONT file name, as real
DriveLM's image names carry it), and a QA item's "frames": K, a question whose answer is defined
over the key frame and the K - 1 frame sets before it. Such a question's category is "motion"
(MOTION), whatever DriveLM section it sits in; `frame_images_over_time` finds its frame sets."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..cameras import CAMERAS
from ..errors import InputError
from ..frames import TimedFrameSet, capture_us, frames_over_time
from .metrics import Question, derive_tags

CATEGORIES = ("perception", "prediction", "planning", "behavior")
MOTION = "motion"                     # the category of a question that needs time (its item's "frames" > 1)


@dataclass
class Frame:
    scene: str
    token: str
    image_paths: dict[str, str]       # as written in the file
    questions: list[Question]
    timestamp_us: int | None = None   # its "timestamp", else CAM_FRONT's capture time from its file name


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def load_frames(path: str | Path) -> list[Frame]:
    """All key frames of a DriveLM v1.1 file, questions numbered per frame over perception,
    prediction, planning, behavior in that order (the challenge's id: scene_frame_i). A question
    with a "tag" list (the challenge's test format) keeps it; others get derive_tags()."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such QA file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a DriveLM v1.1 object {{scene_token: {{key_frames: ...}}}}")
    frames = []
    for scene_token, scene in data.items():
        if not isinstance(scene, dict) or not isinstance(scene.get("key_frames"), dict):
            raise InputError(f"{path}: scene {scene_token} has no key_frames object (not DriveLM layout)")
        for frame_token, frame in scene["key_frames"].items():
            qa = frame.get("QA") if isinstance(frame, dict) else None
            if not isinstance(qa, dict):
                raise InputError(f"{path}: frame {frame_token} has no QA object")
            paths = frame.get("image_paths") or {}
            questions = []
            # The four categories in the challenge's order (its ids count through them), then any
            # other category in file order.
            categories = [c for c in CATEGORIES if c in qa] + [c for c in qa if c not in CATEGORIES]
            for category in categories:
                for item in qa[category]:
                    i = len(questions)
                    if (not isinstance(item, dict) or not isinstance(item.get("Q"), str)
                            or not isinstance(item.get("A", ""), str)):
                        raise InputError(f"{path}: frame {frame_token}, {category} item {i}: needs a string Q "
                                         f"(and A, when given)")
                    answer = item.get("A", "")
                    tags = tuple(item["tag"]) if isinstance(item.get("tag"), list) else derive_tags(item["Q"], answer)
                    needs = item.get("frames", 1)
                    if not _positive_int(needs):
                        raise InputError(f"{path}: frame {frame_token}, {category} item {i}: \"frames\" must be a "
                                         f"whole number of frame sets, at least 1 (got {needs!r})")
                    questions.append(Question(f"{scene_token}_{frame_token}_{i}", frame_token, item["Q"], answer,
                                              tags, MOTION if needs > 1 else category, needs))
            stamp = frame.get("timestamp")
            if stamp is None and isinstance(paths.get("CAM_FRONT"), str):
                stamp = capture_us(paths["CAM_FRONT"])
            elif stamp is not None and not (_positive_int(stamp)):
                raise InputError(f"{path}: frame {frame_token}: \"timestamp\" must be microseconds, a whole "
                                 f"positive number (got {stamp!r})")
            frames.append(Frame(scene_token, frame_token, dict(paths), questions, stamp))
    return frames


def resolve_image(root: Path, written: str, camera: str | None = None) -> Path:
    """Find an image named in a QA file under the frames root. DriveLM writes
    ../nuscenes/samples/CAM_X/file.jpg relative to its own data root; SynthDrive writes paths
    relative to its output folder. Tried in order: the path as written (absolute, or relative to
    root), without its `..`/`.` parts, its part from "samples/" on, without its first folder, then
    samples/CAM_X/<name> and CAM_X/<name> under root (CAM_X: `camera`, else the file's folder)."""
    p = Path(written)
    parts = [part for part in p.parts if part not in ("..", ".")]
    camera = camera or p.parent.name
    candidates = [p] if p.is_absolute() else [root / p]
    if parts and not p.is_absolute():
        candidates.append(root.joinpath(*parts))
    if "samples" in p.parts:
        candidates.append(root.joinpath(*p.parts[p.parts.index("samples"):]))
    if len(parts) > 1 and not p.is_absolute():
        candidates.append(root.joinpath(*parts[1:]))
    candidates += [root / "samples" / camera / p.name, root / camera / p.name]
    for c in dict.fromkeys(candidates):
        if c.is_file():
            return c
    raise InputError(f"image {written!r} not found under {root} "
                     f"(tried {', '.join(str(c) for c in dict.fromkeys(candidates))})")


def frame_images(root: str | Path, frame: Frame) -> dict[str, Path]:
    missing = [cam for cam in CAMERAS if cam not in frame.image_paths]
    if missing:
        raise InputError(f"frame {frame.token}: no image path for {', '.join(missing)}")
    return {cam: resolve_image(Path(root), frame.image_paths[cam], cam) for cam in CAMERAS}


def frame_images_over_time(root: str | Path, frame: Frame, frames: int, stride_s: float | None = 0.5,
                           tolerance_s: float | None = None) -> list[TimedFrameSet]:
    """A key frame's `frames` frame sets, oldest first, the key frame's own images last: the
    files of the same scene `stride_s` apart before it (frames.frames_over_time: matched by the
    capture times in their names; an InputError names the camera and time step without one)."""
    try:
        return frames_over_time(frame_images(root, frame), frames, stride_s, tolerance_s)
    except InputError as exc:
        raise InputError(f"frame {frame.token}: {exc}") from None
