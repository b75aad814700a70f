"""SynthDrive: tagged objects are really drawn where the tags say; same seed -> same bytes."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.synth.camera import rig
from litevlm_runtime.synth.generate import TAG_FRAME, SynthSpec, build_scene, generate, scene_size
from litevlm_runtime.synth.render import render
from litevlm_runtime.synth.world import BARRIER_RGB, COLOURS, LIGHT_RGB

TAG = re.compile(r"<(c\d+),(CAM_[A-Z_]+),([\d.]+),([\d.]+)>")
SEED, SCENES, W, H = 7, 12, 448, 252


@pytest.fixture(scope="module")
def synth_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    generate(out, SynthSpec(SCENES, SEED, W, H, val_fraction=0.25), workers=2, progress=False)
    return out


def _frames(out: Path):
    for split in ("train", "val"):
        for scene_token, scene in json.loads((out / f"{split}.json").read_text()).items():
            for frame_token, frame in scene["key_frames"].items():
                yield scene_token, frame_token, frame


def _expected_colours(obj: dict) -> list[np.ndarray]:
    """What the body pixel of this object looks like: its colour under each face's shading."""
    if obj["kind"] == "traffic light":
        base = LIGHT_RGB[obj["status"]]
    elif obj["kind"] == "barrier":
        base = BARRIER_RGB
    else:
        base = COLOURS[obj["colour"]]
    shades = (1.0,) if obj["kind"] in ("pedestrian", "traffic light") else (0.87, 0.94, 1.0)
    return [np.minimum(255, np.array(base) * s) for s in shades]


def test_layout_and_splits(synth_set):
    train = json.loads((synth_set / "train.json").read_text())
    val = json.loads((synth_set / "val.json").read_text())
    assert len(train) == 9 and len(val) == 3 and not set(train) & set(val)
    for _, _, frame in _frames(synth_set):
        assert set(frame) == {"key_object_infos", "QA", "image_paths"}
        assert set(frame["QA"]) == {"perception", "prediction", "planning", "behavior"}
        for items in frame["QA"].values():
            for item in items:
                assert set(item) == {"Q", "A", "C", "con_up", "con_down", "cluster", "layer"}
                assert item["Q"] and item["A"]
        assert set(frame["image_paths"]) == set(CAMERAS)
        for rel in frame["image_paths"].values():
            assert not Path(rel).is_absolute()
            with Image.open(synth_set / rel) as im:
                assert im.size == (W, H) and im.format == "JPEG"


def test_every_tagged_object_is_drawn_at_its_tag(synth_set):
    """Tags are pixels of the 1600x900 frame (DriveLM's) whatever the render size. For each object
    tag in the QA: (1) a render of the scene at 1600x900 has the object's colour at the tagged
    pixel, unlike the same view without objects; (2) an independent re-render of the scene's object
    mask puts that very object under the tagged pixel; (3) in the set's own JPEG (448x252) the
    tagged point, scaled to that size, lies in the object's box there."""
    truth = json.loads((synth_set / "ground_truth.json").read_text())
    tw, th = TAG_FRAME
    checked = 0
    for _, frame_token, frame in _frames(synth_set):
        gt = truth[frame_token]
        assert gt["image_size"] == [W, H]
        by_id = {o["id"]: o for o in gt["objects"] if o["id"]}
        texts = [frame_token] + [q["Q"] + " " + q["A"] for qs in frame["QA"].values() for q in qs]
        tags = {m for text in texts for m in TAG.findall(text)} | {m for k in frame["key_object_infos"]
                                                                   for m in TAG.findall(k)}
        if not tags:
            continue
        scene = build_scene(SEED, gt["index"], tw, th, None)        # world + images, nothing written
        world = scene["world"]
        cams = rig(tw, th)
        for cid, cam, xs, ys in tags:
            obj = by_id[cid]
            assert cam == obj["camera"]
            x, y = int(float(xs)), int(float(ys))
            image = np.asarray(scene["images"][cam].convert("RGB"), dtype=np.float64)
            patch = np.median(image[max(0, y - 1):y + 2, max(0, x - 1):x + 2].reshape(-1, 3), axis=0)
            empty = np.asarray(render(world, cams[cam], objects=False)[0], dtype=np.float64)[y, x]
            colour_error = min(np.linalg.norm(patch - c) for c in _expected_colours(obj))
            assert colour_error < 50, (frame_token, cid, cam, obj["kind"], obj["colour"], patch)
            assert np.linalg.norm(patch - empty) > 25, (frame_token, cid, cam, patch, empty)
            index = next(i for i, o in enumerate(world.objects)
                         if o.kind == obj["kind"] and abs(o.x - obj["x"]) < 1e-3 and abs(o.y - obj["y"]) < 1e-3)
            mask = render(world, cams[cam])[1]
            assert mask[y, x] == 2 * index + 1, (frame_token, cid, cam, mask[y, x], index)
            if cam in obj["cameras"]:        # drawn at the set's size too (tiny far objects may not be)
                x0, y0, x1, y1 = obj["cameras"][cam]["bbox"]
                sx, sy = float(xs) * W / tw, float(ys) * H / th
                assert x0 - 1 <= sx <= x1 + 1 and y0 - 1 <= sy <= y1 + 1, (frame_token, cid, (sx, sy), (x0, y0, x1, y1))
            checked += 1
    assert checked >= 3 * SCENES          # the check really ran over many tags


def test_questions_name_cameras_and_answers_are_short(synth_set):
    spatial = total = 0
    answers = set()
    for _, _, frame in _frames(synth_set):
        for items in frame["QA"].values():
            for item in items:
                total += 1
                q = item["Q"]
                spatial += bool(TAG.search(q) or re.search(r"to the (front|back)( left| right)? of", q))
                if len(item["A"].split()) <= 3:
                    answers.add(item["A"])
    assert spatial / total > 0.5
    assert {"Yes.", "No.", "A", "B", "C", "D"} <= answers


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes(tmp_path):
    generate(tmp_path / "a", SynthSpec(4, 11, 224, 126, val_fraction=0.25), workers=1, progress=False)
    generate(tmp_path / "b", SynthSpec(4, 11, 224, 126, val_fraction=0.25), workers=2, progress=False)
    generate(tmp_path / "c", SynthSpec(4, 12, 224, 126, val_fraction=0.25), workers=1, progress=False)
    a, b, c = _digest(tmp_path / "a"), _digest(tmp_path / "b"), _digest(tmp_path / "c")
    assert len(a) == 4 * 6 + 4 and a == b
    assert a["train.json"] != c["train.json"]
    # rerun, fewer scenes
    generate(tmp_path / "b", SynthSpec(2, 11, 224, 126, val_fraction=0.0), workers=1, progress=False)
    assert len(list((tmp_path / "b" / "samples").rglob("*.jpg"))) == 2 * 6


def test_questions_do_not_depend_on_resolution():
    """The same scene at three sizes: the same frame, QA, tags and key-object boxes (all in the
    1600x900 frame), while the ground truth's boxes are in each render's own pixels."""
    scenes = [build_scene(3, 5, w, h, None) for w, h in ((320, 180), (960, 540), (1600, 900))]
    frames = [json.dumps(s["scene"]) for s in scenes]
    assert frames[0] == frames[1] == frames[2]
    assert TAG.search(frames[0])
    boxes = [[o["cameras"][o["camera"]]["bbox"] for o in s["ground_truth"]["objects"] if o["camera"] in o["cameras"]]
             for s in scenes]
    assert boxes[0] != boxes[2] and boxes[0]


def test_mixed_sizes_render_each_scene_at_its_drawn_size(tmp_path):
    sizes = [(160, 90), (320, 180)]
    info = generate(tmp_path / "m", SynthSpec(6, 11, val_fraction=0.0, sizes=sizes), workers=1, progress=False)
    assert info["sizes"] == ["160x90", "320x180"]
    truth = json.loads((tmp_path / "m" / "ground_truth.json").read_text())
    drawn = [tuple(truth[t]["image_size"]) for t in sorted(truth, key=lambda t: truth[t]["index"])]
    assert drawn == [scene_size(11, i, sizes) for i in range(6)] and set(drawn) == set(sizes)
    doc = json.loads((tmp_path / "m" / "train.json").read_text())
    for scene in doc.values():
        for fid, frame in scene["key_frames"].items():
            for rel in frame["image_paths"].values():
                with Image.open(tmp_path / "m" / rel) as im:
                    assert im.size == tuple(truth[fid]["image_size"])
    # The QA of a scene is the one its single-size render has.
    single = generate(tmp_path / "s", SynthSpec(6, 11, 160, 90, val_fraction=0.0), workers=1, progress=False)
    assert single["qa_train"] == info["qa_train"]
    assert (tmp_path / "s" / "train.json").read_text() == (tmp_path / "m" / "train.json").read_text()


def test_bad_arguments(tmp_path):
    with pytest.raises(InputError):
        generate(tmp_path / "x", SynthSpec(0, 0), progress=False)
    with pytest.raises(InputError):
        generate(tmp_path / "x", SynthSpec(1, 0, 10, 10), progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "other.txt").write_text("not ours")
    with pytest.raises(InputError, match="not a SynthDrive folder"):
        generate(tmp_path / "busy", SynthSpec(1, 0, 224, 126), progress=False)
