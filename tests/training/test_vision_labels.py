"""Per-visual-token labels from SynthDrive ground truth (training/vision_labels.py)."""

from __future__ import annotations

import numpy as np
import pytest

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.training.vision_labels import INDEX, LABELS, frame_labels, load_vision_labels


def _obj(kind, colour, status, cams, observed=None):
    return {"kind": kind, "colour": colour, "status": status, "observed_status": observed, "cameras": cams}


def test_boxes_map_to_token_cells_by_hand():
    """A 100x50 frame on a 5x5 grid: a cell is 20 x 10 px. Expected cells worked out by hand."""
    gt = {
        "image_size": [100, 50],
        "objects": [
            # Covers x 0..40, y 0..20 exactly: cells (0,0) (0,1) (1,0) (1,1); centre (25, 15) -> cell (1, 1).
            _obj("car", "red", "stopped", {"CAM_BACK": {"bbox": [0, 0, 40, 20], "centre": [25, 15], "pixels": 500}}),
            # Grazes cell (4,4) by 10% of a cell and fills 90% of (4,3): only (4,3) is labelled.
            _obj(
                "pedestrian",
                "blue",
                "walking",
                {"CAM_FRONT": {"bbox": [62, 40, 82, 50], "centre": [70, 45], "pixels": 60}},
            ),
            _obj(
                "traffic light",
                "green",
                "green",
                {"CAM_FRONT": {"bbox": [90, 0, 92, 4], "centre": [91, 2], "pixels": 8}},
            ),
            # Too small to be seen: no label at all.
            _obj(
                "truck",
                "white",
                "going ahead",
                {"CAM_FRONT_LEFT": {"bbox": [0, 0, 2, 2], "centre": [1, 1], "pixels": 2}},
            ),
            _obj(
                "car",
                "black",
                "stopped",
                {"CAM_BACK_RIGHT": {"bbox": [40, 20, 60, 30], "centre": [50, 25], "pixels": 150}},
                observed="Parked",
            ),
        ],
    }
    labels = frame_labels(gt, 5)
    assert labels.shape == (6, 25, len(LABELS))
    back = labels[CAMERAS.index("CAM_BACK")]
    car_bits = [INDEX["kind:car"], INDEX["colour:red"], INDEX["state:stopped"]]
    for cell in range(25):
        expected = {0, 1, 5, 6}
        assert bool(back[cell, car_bits].all()) == (cell in expected), cell
    assert back[6, INDEX["centre:car"]] == 1 and back[:, INDEX["centre:car"]].sum() == 1
    assert back.sum() == 4 * 3 + 1

    front = labels[CAMERAS.index("CAM_FRONT")]
    ped = [INDEX["kind:pedestrian"], INDEX["colour:blue"], INDEX["state:walking"]]
    assert front[4 * 5 + 3, ped].all() and not front[4 * 5 + 4, ped].any()
    light = [INDEX["kind:traffic light"], INDEX["light:green"], INDEX["centre:traffic light"]]
    assert front[4, light].all() and front[4, INDEX["colour:green"]] == 0   # a lamp is not a paint colour
    assert labels[CAMERAS.index("CAM_FRONT_LEFT")].sum() == 0
    parked = labels[CAMERAS.index("CAM_BACK_RIGHT")]
    assert parked[2 * 5 + 2, INDEX["state:parked"]] == 1 and parked[:, INDEX["state:stopped"]].sum() == 0


def test_generated_frames_label_every_visible_object(tmp_path):
    """On a generated set, every object drawn with enough pixels sets its kind and centre bits in
    the cell of its centre, and the label file names frames it lacks clearly."""
    import json

    from litevlm_runtime.synth.generate import SynthSpec, generate

    generate(tmp_path, SynthSpec(2, seed=3, width=160, height=90, val_fraction=0.0), workers=1, progress=False)
    doc = json.loads((tmp_path / "ground_truth.json").read_text())
    ids = list(doc)
    labels = load_vision_labels(tmp_path / "ground_truth.json", ids, 5).numpy()
    checked = 0
    for f, fid in enumerate(ids):
        w, h = doc[fid]["image_size"]
        for obj in doc[fid]["objects"]:
            for cam, view in obj["cameras"].items():
                if view["pixels"] < 4:
                    continue
                cx, cy = view["centre"]
                cell = min(4, int(cy * 5 / h)) * 5 + min(4, int(cx * 5 / w))
                assert labels[f, CAMERAS.index(cam), cell, INDEX[f"centre:{obj['kind']}"]] == 1
                checked += 1
    assert checked > 5
    assert np.isin(labels, (0, 1)).all()
    with pytest.raises(InputError, match="no ground truth"):
        load_vision_labels(tmp_path / "ground_truth.json", ids + ["not-a-frame"], 5)


def test_ground_truth_of_another_layout_is_a_clear_error(tmp_path):
    (tmp_path / "gt.json").write_text('{"f": {"objects": []}}')
    with pytest.raises(InputError, match="not SynthDrive ground truth"):
        load_vision_labels(tmp_path / "gt.json", ["f"], 5)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="cannot read"):
        load_vision_labels(tmp_path / "bad.json", ["f"], 5)
