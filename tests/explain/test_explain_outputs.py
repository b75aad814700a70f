"""What people and their tools get of an explanation: the rig picture (explain/picture.py) and the
Foxglove MCAP with its layout (explain/foxglove_mcap.py), read back with the `mcap` reader and the
schemas the file carries."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import helpers.explain as explain_fixtures
import jsonschema
import matplotlib
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from mcap.reader import make_reader
from PIL import Image

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.explain.foxglove_mcap import (
    ANSWER_TOPIC,
    PICTURE_TOPIC,
    ExplanationMcap,
    camera_topic,
    kept_outline,
    write_layout,
)
from litevlm_runtime.explain.picture import (
    ANSWER_COLOUR,
    DROPPED_SHADE,
    HEAT_ALPHA,
    QUESTION_COLOUR,
    Scale,
    draw_explanation,
    encode_png,
    heatmap_overlay,
    scales_of,
)
from litevlm_runtime.objects import parse_objects
from litevlm_runtime.pipeline.explanation import TokenGrid

explained = explain_fixtures.explained      # the module fixture both explanation test files use
ANSWER_TAG = "It is <c2,CAM_BACK_RIGHT,1000.0,500.0>."    # on a camera the view selector did not keep


def _with_answer_object(e):
    return replace(e, answer=ANSWER_TAG, answer_objects=parse_objects(ANSWER_TAG).objects)


def test_heatmap_blocks_are_the_tokens_cells_through_the_resize():
    """Token (tile, row, col) colours exactly its cell of a 2-tile camera squashed to 400 x 90: the
    blend of the photo and its colour where kept, the photo darkened where dropped."""
    grid = TokenGrid(tiles=2, side=3, tile_px=28)
    values = np.arange(18, dtype=np.float32)
    kept = values % 4 != 1
    photo = np.full((90, 400, 3), 100, np.uint8)
    scale = Scale("t", "viridis", 0.0, 17.0, "")
    out = heatmap_overlay(photo, grid, kept, scale, values, dropped_colour=False)
    lut = (matplotlib.colormaps["viridis"](np.linspace(0, 1, 256))[:, :3] * 255).astype(np.uint8)
    boxes = grid.boxes(400, 90)
    for i in range(18):
        x0, y0, x1, y1 = boxes[i]
        centre = out[int((y0 + y1) / 2), int((x0 + x1) / 2)].astype(int)
        if kept[i]:
            colour = lut[int(values[i] / 17 * 255)]
            expected = np.round(100 * (1 - HEAT_ALPHA) + colour * HEAT_ALPHA)
        else:
            expected = np.full(3, round(100 * DROPPED_SHADE))
        assert np.abs(centre - expected).max() <= 1, (i, centre, expected)


def test_the_rig_picture(explained):
    pipe, answer, trace, e, frames = explained
    e = _with_answer_object(e)
    picture = draw_explanation(e, frames, width=1200)
    assert picture.dtype == np.uint8 and picture.shape[1] == 1200
    flat = picture.reshape(-1, 3)
    # The question's tag (a selected camera) and the answer's (an unselected one) are both marked.
    assert (flat == QUESTION_COLOUR).all(1).sum() > 50 and (flat == ANSWER_COLOUR).all(1).sum() > 50
    png = encode_png(picture)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), picture)
    small = encode_png(picture, colours=64)
    assert len(small) < len(png) and Image.open(io.BytesIO(small)).size == (1200, picture.shape[0])
    # A row with a selected camera shows two images per camera, a row without one image.
    only_front_left = replace(e, views=tuple(replace(v, selected=False, kept=None, attention=None, token_scores=None)
                                             if v.camera != "CAM_FRONT_LEFT" else v for v in e.views))
    assert "CAM_BACK" in e.cameras
    assert draw_explanation(only_front_left, frames, width=1200).shape[0] < picture.shape[0]
    scales = scales_of(e)
    assert scales["attention"].high == max(float(v.attention.max()) for v in e.views if v.selected)


def test_kept_outline_surrounds_exactly_the_kept_cells():
    grid = TokenGrid(tiles=1, side=2, tile_px=28)
    assert kept_outline(grid, np.array([True, True, True, True]), 20, 10) == [
        (0, 0), (10, 0), (10, 0), (20, 0), (0, 10), (10, 10), (10, 10), (20, 10),     # top and bottom
        (0, 0), (0, 5), (20, 0), (20, 5), (0, 5), (0, 10), (20, 5), (20, 10)]         # left and right
    one = kept_outline(grid, np.array([False, True, False, False]), 20, 10)          # the top-right cell
    assert sorted(zip(one[::2], one[1::2])) == sorted([((10, 0), (20, 0)), ((10, 5), (20, 5)),
                                                       ((10, 0), (10, 5)), ((20, 0), (20, 5))])


def _decoder(schema):
    files = descriptor_pb2.FileDescriptorSet.FromString(schema.data)
    pool = descriptor_pool.DescriptorPool()
    for f in files.file:
        pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(schema.name)).FromString


def test_mcap_read_back_has_every_answers_images_annotations_and_heatmaps(explained, tmp_path):
    pipe, answer, trace, e, frames = explained
    stamps = {"q0": 1_537_291_002_287_558_000, "q1": 1_537_291_003_287_558_000}
    explanations = {"q0": e, "q1": _with_answer_object(e)}
    with ExplanationMcap(tmp_path / "run.mcap") as mcap:
        for answer_id, stamp in stamps.items():
            mcap.add(explanations[answer_id], frames, stamp, answer_id, extra={"pipeline": answer.pipeline})
    messages, decoders = {}, {}
    with open(tmp_path / "run.mcap", "rb") as f:
        reader = make_reader(f)
        for schema, channel, message in reader.iter_messages():
            if schema.encoding == "protobuf":
                assert schema.name in ("foxglove.CompressedImage", "foxglove.ImageAnnotations")
                decode = decoders.setdefault(schema.name, _decoder(schema))
                messages[channel.topic, message.log_time] = decode(message.data)
            else:
                assert (schema.encoding, channel.message_encoding) == ("jsonschema", "json")
                body = json.loads(message.data)
                jsonschema.validate(body, json.loads(schema.data))
                messages[channel.topic, message.log_time] = body
    selected = set(e.cameras)
    for answer_id, stamp in stamps.items():
        body = messages[ANSWER_TOPIC, stamp]
        assert body["id"] == answer_id and body["answer"] == explanations[answer_id].answer
        assert body["cameras"] == answer.cameras and body["extra"] == {"pipeline": answer.pipeline}
        assert messages[PICTURE_TOPIC, stamp].format == "jpeg"
        for cam in CAMERAS:
            image = messages[camera_topic(cam, "image"), stamp]
            assert (image.data, image.format, image.frame_id) == (frames[cam], "jpeg", cam)    # the frame as given
            assert (image.timestamp.seconds, image.timestamp.nanos) == divmod(stamp, 10 ** 9)
            size = Image.open(io.BytesIO(image.data)).size
            for kind in ("attention", "token_scores"):
                heat = messages[camera_topic(cam, kind), stamp]
                assert Image.open(io.BytesIO(heat.data)).size == size            # annotations fit both
            notes = messages[camera_topic(cam, "annotations"), stamp]
            assert (notes.timestamp.seconds, notes.timestamp.nanos) == divmod(stamp, 10 ** 9)
            kinds = [p.type for p in notes.points]
            assert kinds == ([2, 4] if cam in selected else [2])             # frame outline, kept-token outline
            objects = [o for o in explanations[answer_id].question_objects + explanations[answer_id].answer_objects
                       if o.camera == cam]
            w, h = size                                                      # 160 x 90: tags are in 1600 x 900
            assert [(c.position.x, c.position.y) for c in notes.circles] == [(o.x * w / 1600, o.y * h / 900)
                                                                             for o in objects]
            assert [t.text for t in notes.texts[1:]] == [o.object_id for o in objects]
    assert ("c2" in [t.text for t in messages[camera_topic("CAM_BACK_RIGHT", "annotations"), stamps["q1"]].texts])
    # The layout names only topics the file has.
    layout = json.loads(write_layout(tmp_path / "layout.json").read_text())
    topics = {t for t, _ in messages}
    named = _topics_in(layout)
    assert named and named <= topics and camera_topic("CAM_BACK", "annotations") in named


def _topics_in(node) -> set[str]:
    if isinstance(node, dict):
        found = {v for k, v in node.items() if k in ("imageTopic", "topicPath")}
        found |= {k for k in node.get("annotations", {})} if isinstance(node.get("annotations"), dict) else set()
        return found.union(*(_topics_in(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_topics_in(v) for v in node))
    return set()
