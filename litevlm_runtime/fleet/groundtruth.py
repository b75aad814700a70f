"""Reference answers for a bag's questions, from DriveLM-layout folders (QA json + samples/).

A bag made by `litevlm bag make` from a DriveLM or SynthDrive folder carries the frames and the
questions, not the answers. An answer is tied back to its DriveLM question by what it was asked
about: the CAM_FRONT image of the frame set the query was matched to. That image is the key
frame's CAM_FRONT file byte for byte, or, when the bag was made with --max-width, the very JPEG
`bag make` re-encodes from it (bag.make._downscale is deterministic), so the match is exact, with
no reliance on stamps (`bag make` moves every scene after the first on its timeline) or on
file names (SynthDrive's carry no capture time). Within the frame, the question text picks the
question. The question keeps the challenge's id (scene_frame_i), frame, category and tags, so
`fleet compare` scores with evaluation/ exactly as `litevlm eval` does.

Bags whose cameras are raw sensor_msgs/Image (bag make --raw) carry decoded pixels: they get no
reference here.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

from ..bag.make import _downscale
from ..errors import InputError
from ..evaluation.data import Frame, load_frames, resolve_image
from ..evaluation.metrics import Question

# PIL is imported where an image's width is read: the rest reads JSON.


@dataclass(frozen=True)
class Reference:
    question: Question
    index: int          # the question's place in its frame (the challenge's order; the graph filter's)
    source: str         # the QA file


def qa_files(folder: Path) -> list[Path]:
    """The DriveLM v1.1 QA files of a folder (SynthDrive's ground_truth.json and synthdrive.json
    are not QA files and are left out)."""
    out = []
    for f in sorted(folder.glob("*.json")):
        try:
            load_frames(f)
        except InputError:
            continue
        out.append(f)
    return out


class GroundTruth:
    """DriveLM-layout folders indexed by the digest of each key frame's CAM_FRONT image."""

    def __init__(self, folders: list[str | Path]):
        self.folders = [Path(f) for f in folders]
        self._frames: list[tuple[Frame, Path, dict[str, Reference]]] = []
        for folder in self.folders:
            if not folder.is_dir():
                raise InputError(f"--ground-truth {folder}: no such folder")
            files = qa_files(folder)
            if not files:
                raise InputError(f"--ground-truth {folder}: no DriveLM QA json file in it")
            for qa in files:
                for frame in load_frames(qa):
                    if "CAM_FRONT" not in frame.image_paths:
                        continue
                    try:
                        front = resolve_image(folder, frame.image_paths["CAM_FRONT"])
                    except InputError:
                        continue          # a QA file covering more frames than the folder has
                    refs: dict[str, Reference] = {}
                    for i, q in enumerate(frame.questions):
                        refs.setdefault(q.question, Reference(q, i, str(qa)))
                    self._frames.append((frame, front, refs))
        self._by_digest: dict[str, dict[str, Reference]] = {}
        for _, front, refs in self._frames:
            self._by_digest.setdefault(_digest(front.read_bytes()), refs)
        self._widths_done: set[int] = set()

    def __len__(self) -> int:
        return len(self._frames)

    def _index_width(self, width: int) -> None:
        """Add the digests of every CAM_FRONT image as `bag make --max-width width` re-encodes it."""

        self._widths_done.add(width)
        for _, front, refs in self._frames:
            original = front.read_bytes()
            scaled = _downscale(original, width)
            if scaled is not original:
                self._by_digest.setdefault(_digest(scaled), refs)

    def frame(self, front_jpeg: bytes) -> dict[str, Reference] | None:
        """The references of the key frame whose CAM_FRONT image this is, by question text."""
        refs = self._by_digest.get(_digest(front_jpeg))
        if refs is None:
            width = _width(front_jpeg)
            if width and width not in self._widths_done:
                self._index_width(width)
                refs = self._by_digest.get(_digest(front_jpeg))
        return refs


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _width(data: bytes) -> int | None:
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data)).width     # the header only
    except (UnidentifiedImageError, OSError):
        return None
