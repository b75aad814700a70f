"""DriveLM object tags as data: `<c1,CAM_BACK,1088.3,497.5>` (object id, camera, pixel centre in that
camera's image, origin top-left) in a question or an answer -> `ObjectRef`s a planner or a display
reads without parsing text.

One syntax for the whole package: `OBJECT_TAG` is what the scoring (evaluation/metrics.py), the
per-template breakdown and the view selector read; `parse_objects` adds what a consumer of the
objects needs on top of it: the object id, the phrase the tag stands in, and every tag-like text
that is not a valid tag (an unknown camera, a missing or non-numeric coordinate, an id that is not
`cN`, no closing `>`) reported by name as a `MalformedTag` instead of being dropped silently.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from .cameras import CAMERAS

# The frame a tag's pixels are in: DriveLM's (nuScenes cameras, 1600 x 900), whatever size the image a
# camera delivers (SynthDrive writes its tags in it at every render size, synth/generate.py). A tag is
# drawn on an image of another size at the same relative place (ObjectRef.pixel).
TAG_FRAME = (1600, 900)

# id, camera, x, y. Whitespace around the commas is tolerated, numbers may be integers or negative
# (a centre just outside the image); any CAM_ name matches here, the rig check is parse_objects'.
OBJECT_TAG = re.compile(r"<c(\d+)\s*,\s*(CAM_[A-Z_]+)\s*,\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*>")
# What looks like an attempt at a tag: angle-bracketed text naming a cN id or a CAM_ camera. It ends
# at '>' (before any further '<' or line break), or, unclosed, at the first white space. Special
# tokens such as <img> or <|im_end|> name neither and are not candidates.
_CANDIDATE = re.compile(r"<(?=[^<>\n]*(?:\bc\d+\b|CAM_))(?:[^<>\n]*>|[^<>\s]*)")
# A sentence ends at . ! or ? followed by whitespace or the end (read on the text with its tags
# masked, so the dots of their coordinates never end one).
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class ObjectRef:
    """One object a text names: `<c1,CAM_BACK,1088.3,497.5>` -> c1 on CAM_BACK at (1088.3, 497.5)."""

    object_id: str        # "c1": DriveLM's id of the object within its key frame
    camera: str           # a camera of the rig (cameras.CAMERAS)
    x: float              # pixel centre in that camera's image (in TAG_FRAME), origin top-left
    y: float
    phrase: str           # the sentence the tag stands in, as written (tags included)
    tag: str              # the tag as written
    start: int            # its span in the text: text[start:end] == tag
    end: int

    def pixel(self, width: int, height: int) -> tuple[float, float]:
        """The object's centre in a width x height image of its camera (the tag is in TAG_FRAME)."""
        return self.x * width / TAG_FRAME[0], self.y * height / TAG_FRAME[1]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MalformedTag:
    """Tag-like text that is not a valid object tag, with why (it names no object)."""

    text: str
    start: int
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ParsedObjects:
    objects: tuple[ObjectRef, ...]      # in text order
    malformed: tuple[MalformedTag, ...]  # in text order

    def cameras(self) -> list[str]:
        """The cameras the objects are on, in rig order."""
        named = {o.camera for o in self.objects}
        return [c for c in CAMERAS if c in named]


def tag_points(text: str) -> list[tuple[float, float]]:
    """(x, y) of every syntactically valid tag, any camera name: the lenient scoring's coordinates."""
    return [(float(x), float(y)) for _, _, x, y in OBJECT_TAG.findall(text)]


def parse_objects(text: str, cameras: tuple[str, ...] | list[str] = CAMERAS) -> ParsedObjects:
    """Every object tag of `text` as an ObjectRef, and every tag-like text that is not one (or names
    a camera outside `cameras`) as a MalformedTag with its reason."""
    objects, malformed = [], []
    masked = OBJECT_TAG.sub(lambda m: "x" * len(m.group(0)), text)
    for m in _CANDIDATE.finditer(text):
        tag = OBJECT_TAG.fullmatch(m.group(0))
        if tag is None:
            malformed.append(MalformedTag(m.group(0), m.start(), _why_malformed(m.group(0))))
            continue
        number, camera, x, y = tag.groups()
        if camera not in cameras:
            malformed.append(MalformedTag(m.group(0), m.start(), f"unknown camera {camera} (the rig: "
                                                                 f"{', '.join(cameras)})"))
            continue
        objects.append(ObjectRef(f"c{number}", camera, float(x), float(y), _sentence(text, masked, m.start()),
                                 m.group(0), m.start(), m.end()))
    return ParsedObjects(tuple(objects), tuple(malformed))


def _sentence(text: str, masked: str, at: int) -> str:
    start = 0
    for end in _SENTENCE_END.finditer(masked):
        if end.end() > at:
            return text[start:end.end()].strip()
        start = end.end()
    return text[start:].strip()


def _why_malformed(candidate: str) -> str:
    """The first thing wrong with a candidate that OBJECT_TAG does not match in full."""
    if not candidate.endswith(">"):
        return "not closed by '>'"
    if candidate[1:2].isspace():
        return "a space after '<'"
    fields = [f.strip() for f in candidate[1:-1].split(",")]
    if len(fields) != 4:
        return f"{len(fields)} fields; a tag has 4 (cN, camera, x, y)"
    object_id, camera, x, y = fields
    if not re.fullmatch(r"c\d+", object_id):
        return f"object id {object_id!r} is not c<number>"
    if not re.fullmatch(r"CAM_[A-Z_]+", camera):
        return f"camera {camera!r} is not a CAM_ name"
    for name, value in (("x", x), ("y", y)):
        if not _NUMBER.fullmatch(value):
            return f"{name} {value!r} is not a number"
    return "not a tag"   # (not reached for the forms above; kept so that every candidate has a reason)
