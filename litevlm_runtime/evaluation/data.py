"""Reading DriveLM v1.1 QA files (real DriveLM or SynthDrive) into questions and frame image sets."""

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
        raise InputError(f"{path}: not a JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a DriveLM v1.1 object {{scene_token: {{key_frames: ...}}}}")
    frames = []
    for scene_token, scene in data.items():
        if not isinstance(scene, dict) or not isinstance(scene.get("key_frames"), dict):
            raise InputError(f"{path}: scene {scene_token} has no key_frames object")
        for frame_token, frame in scene["key_frames"].items():
            qa = frame.get("QA")
            if not isinstance(qa, dict):
                raise InputError(f"{path}: frame {frame_token} has no QA object")
            paths = frame.get("image_paths") or {}
            questions = []
            i = 0
            for category in CATEGORIES:
                for item in qa.get(category, []):
                    if not isinstance(item, dict) or not isinstance(item.get("Q"), str) or not isinstance(
                            item.get("A"), str):
                        raise InputError(f"{path}: frame {frame_token}, {category} item {i}: needs string Q and A")
                    tags = tuple(item["tag"]) if isinstance(item.get("tag"), list) else derive_tags(item["Q"], item["A"])
                    questions.append(Question(f"{scene_token}_{frame_token}_{i}", frame_token, item["Q"], item["A"],
                                              tags, category))
                    i += 1
            frames.append(Frame(scene_token, frame_token, dict(paths), questions))
    return frames


def resolve_image(root: Path, written: str) -> Path:
    """Find an image named in a QA file under the frames root: the path as written (absolute, or
    relative to root), else its part from "samples/" on (DriveLM writes
    ../nuscenes/samples/CAM_X/file.jpg relative to its own data root)."""
    p = Path(written)
    candidates = [p] if p.is_absolute() else [root / p]
    parts = p.parts
    if "samples" in parts:
        candidates.append(root.joinpath(*parts[parts.index("samples"):]))
    candidates.append(root / p.parent.name / p.name)      # root given as the samples/ folder itself
    for c in candidates:
        if c.is_file():
            return c
    raise InputError(f"image {written!r} not found under {root} (tried {', '.join(str(c) for c in candidates)})")


def frame_images(root: str | Path, frame: Frame) -> dict[str, Path]:
    missing = [cam for cam in CAMERAS if cam not in frame.image_paths]
    if missing:
        raise InputError(f"frame {frame.token}: no image path for {', '.join(missing)}")
    return {cam: resolve_image(Path(root), frame.image_paths[cam]) for cam in CAMERAS}
