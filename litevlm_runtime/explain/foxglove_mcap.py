"""Explained answers as an MCAP for Foxglove, written with the `foxglove-sdk` package (its schemas,
channels and MCAP writer), and the Foxglove layout that shows it as one view.

Per explained answer, all at the answer's time (the query's stamp, so that Foxglove's Image panel
pairs each image with its annotations):

    /litevlm/explain/<camera>/image          foxglove.CompressedImage   the camera frame the query was given
    /litevlm/explain/<camera>/attention      foxglove.CompressedImage   the frame under the decoder-attention
                                                                        heatmap (dimmed where the view selector
                                                                        dropped the camera)
    /litevlm/explain/<camera>/token_scores   foxglove.CompressedImage   the frame under the token-score heatmap
    /litevlm/explain/<camera>/annotations    foxglove.ImageAnnotations  the camera's frame outlined (green:
                                                                        selected, grey: not) with its view
                                                                        probability, the kept tokens' outline,
                                                                        and a marker per object tag on it
    /litevlm/explain/picture                 foxglove.CompressedImage   the rig picture (picture.py)
    /litevlm/explain/answer                  JSON (litevlm.ExplainedAnswer) the answer, its id, cameras, view
                                                                        probabilities and objects

Heatmaps and annotations are in the camera frame's own pixels (the tokens mapped back through the
preprocessing's resize, the tags from their frame, objects.TAG_FRAME), so the annotations lie right on
both the frame and its heatmaps.
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import foxglove
import foxglove.layouts as fl
import numpy as np
from foxglove.channels import CompressedImageChannel, ImageAnnotationsChannel
from foxglove.messages import (
    CircleAnnotation,
    Color,
    CompressedImage,
    ImageAnnotations,
    Point2,
    PointsAnnotation,
    PointsAnnotationType,
    TextAnnotation,
    Timestamp,
)

from ..cameras import CAMERAS
from ..errors import InputError
from ..pipeline.explanation import CameraView, Explanation, TokenGrid
from ..stages.preprocess import load_image
from .picture import (
    ANSWER_COLOUR,
    QUESTION_COLOUR,
    UNSELECTED_SHADE,
    draw_explanation,
    encode_jpeg,
    heatmap_overlay,
    scales_of,
)

PREFIX = "/litevlm/explain"
ANSWER_TOPIC = f"{PREFIX}/answer"
PICTURE_TOPIC = f"{PREFIX}/picture"
KINDS = ("image", "attention", "token_scores", "annotations")
SELECTED, UNSELECTED, KEPT = (0.2, 0.85, 0.3, 1.0), (0.55, 0.55, 0.55, 1.0), (1.0, 1.0, 1.0, 0.9)
ANSWER_SCHEMA = {
    "title": "litevlm.ExplainedAnswer",
    "type": "object",
    "required": ["id", "stamp_ns", "question", "answer", "cameras", "views", "question_objects", "answer_objects"],
    "properties": {
        "id": {"type": "string"},
        "stamp_ns": {"type": "integer"},
        "question": {"type": "string"},
        "answer": {"type": "string"},
        "cameras": {"type": "array", "items": {"type": "string"}},
        "view_reason": {"type": "string"},
        "views": {"type": "array", "items": {"type": "object", "properties": {
            "camera": {"type": "string"}, "selected": {"type": "boolean"}, "view_score": {"type": "number"},
            "view_probability": {"type": ["number", "null"]}, "kept_tokens": {"type": "integer"},
            "tokens": {"type": "integer"}}}},
        "attention_layers": {"type": "array", "items": {"type": "integer"}},
        "visual_share": {"type": "number"},
        "question_objects": {"type": "array", "items": {"$ref": "#/$defs/object"}},
        "answer_objects": {"type": "array", "items": {"$ref": "#/$defs/object"}},
        "malformed": {"type": "array", "items": {"type": "object"}},
        "extra": {"type": "object"},
    },
    "$defs": {"object": {"type": "object", "required": ["object_id", "camera", "x", "y"], "properties": {
        "object_id": {"type": "string"}, "camera": {"type": "string"}, "x": {"type": "number"},
        "y": {"type": "number"}, "phrase": {"type": "string"}, "tag": {"type": "string"}}}},
}


def camera_topic(camera: str, kind: str) -> str:
    return f"{PREFIX}/{camera.lower()}/{kind}"


class ExplanationMcap:
    """Writes explained answers into one MCAP file (a context manager; `close()` finishes the file).

        with ExplanationMcap("run.mcap") as mcap:
            mcap.add(explanation, images, stamp_ns, answer_id)
    """

    def __init__(self, path: str | Path, cameras=CAMERAS, picture: bool = True, jpeg_quality: int = 85):
        self.path, self.cameras, self.picture, self.quality = Path(path), tuple(cameras), picture, jpeg_quality
        self.context = foxglove.Context()          # this file's own channels, not the process-wide ones
        self.writer = foxglove.open_mcap(self.path, allow_overwrite=True, context=self.context)
        self.images = {(c, k): CompressedImageChannel(camera_topic(c, k), context=self.context)
                       for c in self.cameras for k in KINDS[:3]}
        self.annotations = {c: ImageAnnotationsChannel(camera_topic(c, "annotations"), context=self.context)
                            for c in self.cameras}
        self.picture_channel = CompressedImageChannel(PICTURE_TOPIC, context=self.context)
        self.answers = foxglove.Channel(ANSWER_TOPIC, context=self.context, message_encoding="json",
                                        schema=foxglove.Schema(name=ANSWER_SCHEMA["title"], encoding="jsonschema",
                                                               data=json.dumps(ANSWER_SCHEMA).encode()))
        self.count = 0

    def __enter__(self) -> "ExplanationMcap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.writer.close()

    def add(self, explanation: Explanation, images: dict, stamp_ns: int, answer_id: str = "",
            extra: dict | None = None) -> None:
        """One explained answer: `images` camera -> what the query was given (JPEG/PNG bytes, a path, an
        HxWx3 uint8 RGB array); `stamp_ns` its time (the query's stamp); `extra` any JSON-able fields
        (the answer record's) added to the answer message under "extra"."""
        stamp = Timestamp(int(stamp_ns // 1_000_000_000), int(stamp_ns % 1_000_000_000))
        scales = scales_of(explanation)
        views = {v.camera: v for v in explanation.views}
        for camera in self.cameras:
            if images.get(camera) is None or camera not in views:
                continue
            data, fmt, photo = _frame(images[camera], camera, self.quality)
            h, w = photo.shape[:2]
            self.images[camera, "image"].log(CompressedImage(timestamp=stamp, frame_id=camera, data=data,
                                                             format=fmt), log_time=stamp_ns)
            view = views[camera]
            for kind, values, scale, scored in (("attention", view.attention, scales["attention"], False),
                                                ("token_scores", view.token_scores, scales["score"], True)):
                if view.selected and values is not None:
                    shown = heatmap_overlay(photo, explanation.grid, view.kept, scale, values, scored)
                else:
                    shown = cv2.convertScaleAbs(photo, alpha=UNSELECTED_SHADE if not view.selected else 1.0)
                self.images[camera, kind].log(CompressedImage(timestamp=stamp, frame_id=camera, format="jpeg",
                                                              data=encode_jpeg(shown, self.quality)),
                                              log_time=stamp_ns)
            self.annotations[camera].log(_annotations(explanation, view, explanation.grid, w, h, stamp),
                                         log_time=stamp_ns)
        if self.picture:
            self.picture_channel.log(CompressedImage(timestamp=stamp, frame_id="rig", format="jpeg",
                                                     data=encode_jpeg(draw_explanation(explanation, images))),
                                     log_time=stamp_ns)
        self.answers.log(answer_message(explanation, stamp_ns, answer_id, extra), log_time=stamp_ns)
        self.count += 1


def answer_message(e: Explanation, stamp_ns: int, answer_id: str = "", extra: dict | None = None) -> dict:
    """The answer message (ANSWER_SCHEMA): what a tool reads without the pictures."""
    return {
        "id": answer_id, "stamp_ns": int(stamp_ns), "question": e.question, "answer": e.answer,
        "cameras": e.cameras, "view_reason": e.view_reason,
        "views": [{"camera": v.camera, "selected": v.selected, "view_score": v.view_score,
                   "view_probability": v.view_probability,
                   "kept_tokens": int(v.kept.sum()) if v.kept is not None else 0,
                   "tokens": int(v.kept.size) if v.kept is not None else 0} for v in e.views],
        "attention_layers": list(e.attention_layers), "visual_share": e.visual_share,
        "question_objects": [o.to_dict() for o in e.question_objects],
        "answer_objects": [o.to_dict() for o in e.answer_objects],
        "malformed": [m.to_dict() for m in e.malformed], "extra": dict(extra or {}),
    }


def layout(cameras=CAMERAS) -> fl.Layout:
    """The Foxglove layout of such an MCAP: the six cameras in the rig's 2 x 3 arrangement (each the
    attention heatmap with the camera's annotations), then the rig picture beside the answer."""
    def camera_panel(camera: str) -> fl.SplitItem:
        mode = fl.ImageModeConfig(image_topic=camera_topic(camera, "attention"),
                                  annotations={camera_topic(camera, "annotations"): fl.ImageAnnotationSettings(
                                      visible=True)})
        return fl.SplitItem(content=fl.ImagePanel(title=camera, config=fl.ImageConfig(image_mode=mode)))

    rig = [[c for c in row if c in cameras] for row in (("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT"),
                                                         ("CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT"))]
    rows = [fl.SplitItem(content=fl.SplitContainer(direction="row", items=[camera_panel(c) for c in row]))
            for row in rig if row]
    picture = fl.ImagePanel(title="explanation", config=fl.ImageConfig(
        image_mode=fl.ImageModeConfig(image_topic=PICTURE_TOPIC)))
    answer = fl.RawMessagesPanel(title="answer", config=fl.RawMessagesConfig(topic_path=ANSWER_TOPIC,
                                                                             expansion="all"))
    bottom = fl.SplitItem(proportion=1.4, content=fl.SplitContainer(
        direction="row", items=[fl.SplitItem(proportion=2, content=picture), fl.SplitItem(content=answer)]))
    return fl.Layout(content=fl.SplitContainer(direction="column", items=[*rows, bottom]))


def write_layout(path: str | Path, cameras=CAMERAS) -> Path:
    path = Path(path)
    path.write_text(json.dumps(json.loads(layout(cameras).to_json()), indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------------------------- parts
def _frame(source, camera: str, quality: int) -> tuple[bytes, str, np.ndarray]:
    """(bytes for the image topic, their format, the frame as RGB at its own size). JPEG/PNG bytes and
    files are passed on as they are; arrays are encoded as JPEG."""
    if isinstance(source, (str, Path)):
        source = Path(source).read_bytes()
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        fmt = "jpeg" if data[:3] == b"\xff\xd8\xff" else "png" if data[:8] == b"\x89PNG\r\n\x1a\n" else ""
        if not fmt:
            raise InputError(f"{camera}: the image is neither JPEG nor PNG; Foxglove's CompressedImage needs one",
                             camera=camera)
        return data, fmt, np.asarray(load_image(data, camera, (1 << 30, 1 << 30), jpeg_draft=False))
    photo = np.asarray(load_image(source, camera, (1 << 30, 1 << 30), jpeg_draft=False))
    return encode_jpeg(photo, quality), "jpeg", photo


def _colour(rgba) -> Color:
    r, g, b, a = rgba
    return Color(r=r, g=g, b=b, a=a)


def _rgb(rgb: tuple[int, int, int], a: float = 1.0) -> Color:
    return Color(r=rgb[0] / 255, g=rgb[1] / 255, b=rgb[2] / 255, a=a)


def kept_outline(grid: TokenGrid, kept: np.ndarray, width: int, height: int) -> list[tuple[float, float]]:
    """The boundary of the kept tokens' cells in a width x height frame's pixels, as the point pairs
    of a LINE_LIST: every cell edge with a kept token on one side and a dropped one (or the image's
    border) on the other."""
    k = np.pad(grid.image(np.asarray(kept, np.uint8)).astype(bool), 1)      # [side + 2, tiles*side + 2]
    sx, sy = width / (k.shape[1] - 2), height / (k.shape[0] - 2)
    points: list[tuple[float, float]] = []
    rows, cols = np.nonzero(k[1:, 1:-1] != k[:-1, 1:-1])                  # horizontal edges above cell rows
    for r, c in zip(rows.tolist(), cols.tolist()):
        points += [(c * sx, r * sy), ((c + 1) * sx, r * sy)]
    rows, cols = np.nonzero(k[1:-1, 1:] != k[1:-1, :-1])                  # vertical edges left of cell columns
    for r, c in zip(rows.tolist(), cols.tolist()):
        points += [(c * sx, r * sy), (c * sx, (r + 1) * sy)]
    return points


def _annotations(e: Explanation, view: CameraView, grid: TokenGrid, w: int, h: int, stamp: Timestamp):
    colour = _colour(SELECTED if view.selected else UNSELECTED)
    frame = PointsAnnotation(timestamp=stamp, type=PointsAnnotationType.LineLoop, outline_color=colour,
                             thickness=max(4.0, w / 200), points=[Point2(x=x, y=y) for x, y in
                                                                  ((2, 2), (w - 2, 2), (w - 2, h - 2), (2, h - 2))])
    p = "" if view.view_probability is None else f"p {view.view_probability:.2f}  "
    status = (f"{view.camera}  {p}score {view.view_score:.2f}  "
              + (f"kept {int(view.kept.sum())}/{view.kept.size} tokens" if view.selected else "not selected"))
    size = max(14.0, w / 45)
    texts = [TextAnnotation(timestamp=stamp, position=Point2(x=10, y=10 + size), text=status, font_size=size,
                            text_color=colour, background_color=Color(r=0, g=0, b=0, a=0.6))]
    points = [frame]
    if view.selected:
        outline = kept_outline(grid, view.kept, w, h)
        points.append(PointsAnnotation(timestamp=stamp, type=PointsAnnotationType.LineList, thickness=2,
                                       outline_color=_colour(KEPT), points=[Point2(x=x, y=y) for x, y in outline]))
    circles = []
    for objects, rgb in ((e.question_objects, QUESTION_COLOUR), (e.answer_objects, ANSWER_COLOUR)):
        for o in objects:
            if o.camera != view.camera:
                continue
            x, y = o.pixel(w, h)                       # the tag's frame -> this frame's pixels
            circles.append(CircleAnnotation(timestamp=stamp, position=Point2(x=x, y=y), diameter=size * 2.5,
                                            thickness=4, outline_color=_rgb(rgb)))
            texts.append(TextAnnotation(timestamp=stamp, position=Point2(x=x + size * 1.5, y=y - size * 1.5),
                                        text=o.object_id, font_size=size, text_color=_rgb(rgb),
                                        background_color=Color(r=0, g=0, b=0, a=0.6)))
    return ImageAnnotations(timestamp=stamp, circles=circles, points=points, texts=texts)
