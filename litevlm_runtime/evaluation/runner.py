"""Running a model over a DriveLM-format QA file: six images + one question at a time through
the Pipeline, one frame's questions after another (so a visual feature cache can serve them).

With temporal.frames K > 1 every question is asked with its key frame's K frame sets (the key frame
and the K - 1 sets of its scene temporal.stride_s apart before it: evaluation.data
.frame_images_over_time); how many of them a question gets is the pipeline's time selection. A key
frame without them gets each of its questions recorded with the error naming the camera and step."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from ..cameras import CAMERAS
from ..errors import InputError
from ..pipeline.frame_sets import FrameSet
from ..pipeline.pipeline import Pipeline
from ..pipeline.request import QueryRequest
from .choices import closed_form_choices
from .data import Frame, frame_images, frame_images_over_time, load_frames, resolve_image
from .metrics import ACCURACY, Question

BLANK_GREY = 128
DEFAULT_SIZE = (1600, 900)


def blank_frame(root: Path, frame: Frame) -> dict[str, np.ndarray]:
    """A constant grey image per camera, of the frame's real image size when its files are there:
    the text-only baseline sees exactly the input shapes the real evaluation sees."""
    out = {}
    for cam in CAMERAS:
        size = DEFAULT_SIZE
        try:
            with Image.open(resolve_image(root, frame.image_paths.get(cam, ""))) as im:
                size = im.size
        except (InputError, OSError):
            pass
        out[cam] = np.full((size[1], size[0], 3), BLANK_GREY, dtype=np.uint8)
    return out


def frame_sets(root: Path, frame: Frame, frames: int, stride_s: float, blank_images: bool) -> list[FrameSet]:
    """A key frame's `frames` frame sets, oldest first, each camera's image read once and keyed by
    its file (the feature cache keeps each camera frame once over every window it is in)."""
    if frames == 1:
        paths = [frame_images(root, frame)]
    else:
        paths = [s.paths for s in frame_images_over_time(root, frame, frames, stride_s)]
    blank = blank_frame(root, frame) if blank_images else None
    return [FrameSet(blank or {cam: p.read_bytes() for cam, p in ps.items()},
                     {cam: (str(p), blank_images) for cam, p in ps.items()}) for ps in paths]


def accuracy_questions(frame: Frame) -> list[Question]:
    """The questions of a frame that can count for accuracy: the closed-form ones, and the frame's
    first question (under the challenge's rules its answer sets the frame's graph, which decides
    which later questions are scored; metrics.py rule 2). Accuracy over them is the accuracy over
    every question, whatever the rules."""
    return [q for i, q in enumerate(frame.questions) if i == 0 or ACCURACY in q.tags]


def select(frames: list[Frame], limit: int | None, accuracy_only: bool = False) -> list[tuple[Frame, list[Question]]]:
    """The first `limit` questions in file order, grouped by frame (`accuracy_only`: of
    accuracy_questions)."""
    out, left = [], limit
    for frame in frames:
        qs = accuracy_questions(frame) if accuracy_only else frame.questions
        qs = qs if left is None else qs[:left]
        if qs:
            out.append((frame, qs))
        if left is not None:
            left -= len(qs)
            if left <= 0:
                break
    return out


@dataclass(frozen=True)
class EvalPlan:
    """Which questions run_model asks and how: `blank_images` (grey images of the real size: the
    text-only baseline), the first `limit` questions (select()), `accuracy_only` (only those scored by
    accuracy), `constrain` (a closed-form question's answer constrained to its choices)."""
    blank_images: bool = False
    limit: int | None = None
    constrain: bool = False
    accuracy_only: bool = False


def run_model(model_dir: str | Path, data: str | Path, frames_root: str | Path, options=None,
              plan: EvalPlan = EvalPlan(), progress: bool = True, info: dict | None = None) -> list[dict]:
    """Answer every question; one record per question (the challenge's output.json fields
    id/question/gt_answer/answer, plus what the pipeline reports). A question the pipeline rejects
    (InputError) is recorded with its error and an empty answer, never dropped. `plan.constrain`: a
    closed-form question's answer is constrained to its choices (evaluation/choices.py), which
    the record keeps. `info`, when given, receives the arena's bytes (all buffers, and the KV caches
    alone) and its arena.kv_dtype."""
    blank_images, constrain = plan.blank_images, plan.constrain
    root = Path(frames_root)
    work = select(load_frames(data), plan.limit, plan.accuracy_only)
    if not work:
        raise InputError(f"{data}: no questions to evaluate")
    pipe = Pipeline.from_pretrained(model_dir, options)
    if info is not None:
        arena = pipe.rt.arena
        info |= {"arena_bytes": arena.nbytes(), "kv_bytes": arena.kv_nbytes(), "kv_dtype": arena.limits.kv_dtype}
    records = []
    bar = tqdm(total=sum(len(qs) for _, qs in work), desc="eval", unit="q", disable=not progress)
    temporal = pipe.rt.options.temporal
    try:
        for frame, questions in work:
            missing = None       # read once per frame: every question of the frame gets the very same inputs
            if temporal.frames == 1:
                images = blank_frame(root, frame) if blank_images else \
                    {cam: p.read_bytes() for cam, p in frame_images(root, frame).items()}
                sets = [FrameSet(images, {cam: (frame.token, blank_images) for cam in images})]
            else:
                try:
                    sets = frame_sets(root, frame, temporal.frames, temporal.stride_s, blank_images)
                except InputError as exc:      # (a camera's frame set at some step is not there)
                    missing = str(exc)
            for q in questions:
                record = {"id": q.id, "question": q.question, "gt_answer": q.answer, "category": q.category,
                          "tags": list(q.tags)}
                choices = closed_form_choices(q.question) if constrain else None
                if choices:
                    record["choices"] = choices
                try:
                    if missing:
                        raise InputError(missing)
                    ans = pipe.answer(sets, QueryRequest(q.question, choices=choices))
                    record |= {"answer": ans.text, "cameras": ans.cameras, "total_ms": ans.total_ms,
                               "stage_ms": ans.stage_ms, "input_tokens": ans.input_tokens,
                               "kept_tokens": ans.kept_tokens, "visual_tokens": ans.visual_tokens,
                               "accepted_length": ans.accepted_length, "pipeline": ans.pipeline,
                               "frames": ans.frames, "encoded_views": ans.encoded_views,
                               "reused_views": ans.reused_views, "kept_per_frame": ans.kept_per_frame}
                except InputError as exc:
                    record |= {"answer": "", "error": str(exc)}
                records.append(record)
                bar.update(1)
    finally:
        bar.close()
    return records


def read_predictions(path: str | Path) -> dict[str, str]:
    """Predictions to score: the challenge's output.json (a list of {id, answer, ...}), this
    command's --predictions file (same), or a plain {id: answer} object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such predictions file") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON ({exc})") from None
    if isinstance(data, dict):
        if all(isinstance(v, str) for v in data.values()):
            return data
        raise InputError(f"{path}: an object of predictions must map id -> answer string")
    if isinstance(data, list) and all(isinstance(r, dict) and "id" in r and "answer" in r for r in data):
        return {r["id"]: r["answer"] if isinstance(r["answer"], str) else "" for r in data}
    raise InputError(f"{path}: expected a list of {{id, answer}} records or an {{id: answer}} object")
