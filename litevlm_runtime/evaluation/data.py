"""The one DriveLM reader: DriveLM v1.1 QA files (real DriveLM or SynthDrive) into key frames,
their questions and their six image files. Evaluation, every trainer, calibration and `bag make`
read DriveLM data through it, so a question is numbered and an image path resolved one way."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..cameras import CAMERAS
from ..errors import InputError
from .metrics import Question, derive_tags

CATEGORIES = ("perception", "prediction", "planning", "behavior")


@dataclass
class Frame:
    scene: str
    token: str
    image_paths: dict[str, str]       # as written in the file
    questions: list[Question]


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
                    questions.append(Question(f"{scene_token}_{frame_token}_{i}", frame_token, item["Q"], answer,
                                              tags, category))
            frames.append(Frame(scene_token, frame_token, dict(paths), questions))
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
