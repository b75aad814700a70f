"""Per-visual-token object labels from SynthDrive's ground truth: direct supervision for the vision
tower while `train vlm` trains the whole model.

Why: through the answer tokens alone, the vision tower of a from-scratch model learns slowly
(a colour question gives one bit about one object per answer). The generator knows every drawn
object's camera, bounding box, kind, colour and state, so each visual token (one cell of the
tile's grid after pixel shuffle) gets a multi-hot target of what is drawn in it, predicted by a
linear probe on the token the decoder sees. The probe exists only during training: it is not
part of the checkpoint, and inference is unchanged.

A token covers a (tile / grid)-pixel square of the camera's tile; the tile is the whole frame
resized without keeping the aspect (as `preprocess.to_tiles_uint8` does with one tile per
camera), so a box (x0, y0, x1, y1) in frame pixels maps to x * grid / width, y * grid / height in
token cells.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..cameras import CAMERAS
from ..errors import InputError

KINDS = ("car", "truck", "bus", "pedestrian", "barrier", "traffic light")
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "orange")
LIGHT_STATES = ("red", "yellow", "green")
STATES = ("going ahead", "turn left", "turn right", "stopped", "parked", "walking", "standing")

# Label layout: what is drawn in the cell (kind, body colour, light state, motion state), then
# "an object of this kind has its centre in this cell" so that counts are one bit per object.
LABELS = ([f"kind:{k}" for k in KINDS] + [f"colour:{c}" for c in COLOURS] + [f"light:{s}" for s in LIGHT_STATES]
          + [f"state:{s}" for s in STATES] + [f"centre:{k}" for k in KINDS])
INDEX = {name: i for i, name in enumerate(LABELS)}
MIN_PIXELS = 4               # objects covering fewer pixels are not visible enough to label
MIN_OVERLAP = 0.25           # of the smaller of (cell, box): a box corner grazing a cell does not count


def object_labels(obj: dict) -> list[int]:
    """The label indices an object sets in every cell it covers (centre bits excluded)."""
    kind = obj["kind"]
    if kind not in KINDS:
        raise InputError(f"ground truth: unknown object kind {kind!r}")
    out = [INDEX[f"kind:{kind}"]]
    if kind == "traffic light":
        if obj["status"] in LIGHT_STATES:
            out.append(INDEX[f"light:{obj['status']}"])
        return out
    if obj.get("colour") in COLOURS:
        out.append(INDEX[f"colour:{obj['colour']}"])
    state = "parked" if obj.get("observed_status") == "Parked" else obj.get("status")
    if state in STATES:
        out.append(INDEX[f"state:{state}"])
    return out


def frame_labels(gt: dict, grid: int) -> np.ndarray:
    """uint8 [cameras, grid * grid, len(LABELS)] for one frame's ground truth."""
    width, height = gt["image_size"]
    labels = np.zeros((len(CAMERAS), grid * grid, len(LABELS)), dtype=np.uint8)
    sx, sy = grid / width, grid / height
    for obj in gt["objects"]:
        bits = object_labels(obj)
        for cam, view in obj.get("cameras", {}).items():
            if cam not in CAMERAS or view.get("pixels", 0) < MIN_PIXELS:
                continue
            c = CAMERAS.index(cam)
            x0, y0, x1, y1 = view["bbox"]
            gx0, gy0, gx1, gy1 = x0 * sx, y0 * sy, x1 * sx, y1 * sy
            box_area = max((gx1 - gx0) * (gy1 - gy0), 1e-6)
            for r in range(max(0, int(gy0)), min(grid, int(np.ceil(gy1)))):
                for col in range(max(0, int(gx0)), min(grid, int(np.ceil(gx1)))):
                    overlap = (min(gx1, col + 1) - max(gx0, col)) * (min(gy1, r + 1) - max(gy0, r))
                    if overlap >= MIN_OVERLAP * min(1.0, box_area):
                        labels[c, r * grid + col, bits] = 1
            cx, cy = view["centre"]
            r, col = min(grid - 1, int(cy * sy)), min(grid - 1, int(cx * sx))
            labels[c, r * grid + col, INDEX[f"centre:{obj['kind']}"]] = 1
    return labels


def load_vision_labels(path: Path, frame_ids: list[str], grid: int) -> torch.Tensor:
    """uint8 [frames, cameras, grid * grid, len(LABELS)] for frame ids (DriveLM key-frame tokens)
    from a SynthDrive `ground_truth.json`."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read the SynthDrive ground truth ({exc})") from None
    missing = [f for f in frame_ids if f not in doc]
    if missing:
        raise InputError(f"{path}: no ground truth for {len(missing)} training frames (first {missing[0]!r}); "
                         "--vision-labels needs the ground_truth.json written with the training data")
    try:
        return torch.from_numpy(np.stack([frame_labels(doc[f], grid) for f in frame_ids]))
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path}: not SynthDrive ground truth (a frame lacks image_size, objects or an "
                         f"object's cameras/bbox/centre: {exc!r})") from None


class VisionProbe(nn.Module):
    """Linear probe: visual token (decoder width) -> label logits. Training only."""

    def __init__(self, width: int, prior: torch.Tensor | None = None):
        """prior: each label's positive rate; the probe starts at it (zero weights, logit bias), so
        its first gradients are not a burst from a random probe into a trained vision tower."""
        super().__init__()
        self.linear = nn.Linear(width, len(LABELS))
        nn.init.zeros_(self.linear.weight)
        if prior is not None:
            p = prior.double().clamp(1e-4, 1 - 1e-4)
            with torch.no_grad():
                self.linear.bias.copy_(torch.log(p / (1 - p)).float())

    def forward(self, visual: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum over tokens of the label-summed binary cross-entropy (visual [N, D], targets [N, L])."""
        logits = self.linear(visual).float()
        return F.binary_cross_entropy_with_logits(logits, targets.float(), reduction="sum")
