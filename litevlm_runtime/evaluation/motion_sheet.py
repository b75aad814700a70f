"""A picture of one SynthDrive scene in motion: its six cameras (rows) at its K time steps
(columns, oldest first), read back through the frame-set loader a K-frame question uses
(data.frame_images_over_time), with each key object's ground-truth position at every
step (its track in ground_truth.json, projected into the cameras) marked by its tag, and its
motion labels listed underneath. Where a mark sits on the object in every column, the rendered
sequence and the ground truth the questions come from agree."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ..errors import InputError
from ..synth.camera import NEAR_M, rig
from .data import frame_images_over_time, load_frames

ROWS = ("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT")
MARK = (255, 0, 255)


def sequence_sheet(set_dir: str | Path, out: str | Path, scene: int = 0, tile_width: int = 400) -> Path:
    set_dir = Path(set_dir)
    info = json.loads((set_dir / "synthdrive.json").read_text())
    frames, stride = info.get("frames", 1), info.get("stride_s")
    if frames < 2:
        raise InputError(f"{set_dir}: a single-frame set (made without --frames K); nothing moves to show")
    truth = next((g for g in json.loads((set_dir / "ground_truth.json").read_text()).values()
                  if g["index"] == scene), None)
    if truth is None:
        raise InputError(f"{set_dir}: no scene {scene} (the set has {info['scenes']})")
    key = next(f for split in ("train", "val") for f in load_frames(set_dir / f"{split}.json")
               if f.scene == truth["scene_token"])
    sets = frame_images_over_time(set_dir, key, frames, stride)
    width, height = truth["image_size"]
    tile_h = round(tile_width * height / width)
    head, legend_line = 22, 16
    tagged = [o for o in truth["objects"] if o["id"]]
    sheet = Image.new("RGB", (tile_width * frames, head + tile_h * len(ROWS) + legend_line * (len(tagged) + 2)),
                      (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    cams = rig(width, height)
    ego = truth["ego"]["track"]
    for k, frame_set in enumerate(sets):
        draw.text((k * tile_width + 6, 4), f"t = {frame_set.offset_s:+.1f} s   ({frame_set.stamp_us} us)"
                  + ("   key frame" if k == frames - 1 else ""), fill=(0, 0, 0))
        for r, cam in enumerate(ROWS):
            x0, y0 = k * tile_width, head + r * tile_h
            with Image.open(frame_set.paths[cam]) as im:
                sheet.paste(im.convert("RGB").resize((tile_width, tile_h), Image.BILINEAR), (x0, y0))
            if k == 0:
                draw.text((x0 + 4, y0 + 4), cam, fill=(255, 255, 255))
            scale = tile_width / width
            for obj in tagged:
                pose = obj["track"][k]
                point = cams[cam].to_camera(np.array([[pose["x"] - ego[k]["x"], pose["y"], 0.0]]))
                if point[0, 2] < NEAR_M:
                    continue
                u, v = cams[cam].project(point)[0] * scale
                if 0 <= u < tile_width and 0 <= v < tile_h:
                    draw.ellipse((x0 + u - 3, y0 + v - 3, x0 + u + 3, y0 + v + 3), outline=MARK, width=2)
                    draw.text((x0 + u + 5, y0 + v - 12), obj["id"], fill=MARK)
    y = head + tile_h * len(ROWS) + 4
    draw.text((6, y), f"scene {scene} of seed {info['seed']}: {frames} frame sets {stride:g} s apart; ego "
                      f"{truth['ego']['speed']} ({truth['ego']['speed_mps']:g} m/s); marks: each key object's "
                      f"ground-truth position at each step", fill=(0, 0, 0))
    for i, obj in enumerate(tagged, start=1):
        m = obj["motion"]
        draw.text((6, y + i * legend_line),
                  f"{obj['id']}: {obj['colour']} {obj['kind']} ({obj['camera']}): {m['status']}, moving "
                  f"{m['moving']}, approaching {m['approaching']}, crosses the ego lane {m['crosses_ego_lane']} "
                  f"(speed {m['speed_mps']:g} m/s, closing {m['closing_mps']:+.1f} m/s, across {m['lateral_mps']:+.1f}"
                  f" m/s)", fill=(0, 0, 0))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    return out
