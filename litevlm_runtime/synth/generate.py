"""`litevlm synth`: scenes -> six JPEGs each + DriveLM v1.1 QA (train/val) + per-object ground truth.

Scene i of seed S is drawn from its own RNG, numpy's default_rng([S, i]): a scene does not depend
on how many scenes are generated, on the worker that renders it, or on the image size. The QA
does not depend on the image size either: which objects count as visible is decided on a fixed
480x270 render, and object tags `<cN,CAM_X,x,y>` and key-object 2d boxes are pixels of the
1600x900 frame whatever size the images are rendered at, as in DriveLM, whose tags are pixels
of nuScenes' 1600x900 camera images (a render at 480x270 asks the same questions as one at
1600x900, so a model is not shown the same object under different coordinates; per-render
pixel boxes are in ground_truth.json). `sizes` renders each scene at one of several sizes,
drawn per scene: a training set at mixed resolutions.

Output layout (DIR):
  train.json, val.json     DriveLM v1.1: {scene_token: {scene_description, key_frames: {frame_token:
                           {key_object_infos, QA: {perception, prediction, planning, behavior},
                           image_paths: {CAM_X: "samples/CAM_X/<file>.jpg"}}}}}; paths relative to DIR
  ground_truth.json        {frame_token: {scene_token, split, ego, road, objects: [...]}} every visible
                           object: kind, colour, status, distance, cameras with pixel centre and box
  samples/CAM_X/*.jpg      the images
  synthdrive.json          how the set was made (seed, scenes, size, version)

In motion (`frames` K > 1, `stride` S seconds; motion.py, docs/motion.md): each scene is rendered
at K time steps S apart, the key frame last, as nuScenes names its camera files:
samples/CAM_X/synthdrive-s<seed>-<index>__CAM_X__<capture time, 16-digit microseconds>.jpg. The QA
is the key frame's; its frame carries "timestamp" (microseconds, as nuScenes' sample) and every
question whose answer needs time carries "frames": K. ground_truth.json adds each object's pose at
every step and its motion labels, and the ego's; synthdrive.json adds frames and stride_s. A
single-frame set (K = 1) is exactly what it was.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..cameras import CAMERAS
from ..errors import InputError
from ..objects import TAG_FRAME  # tags and 2d boxes in the QA are pixels of this frame (DriveLM's), at any size
from . import motion
from .camera import rig, sector_camera
from .qa import frame_qa
from .render import background, render, render_alone
from .world import World, decide_ego, sample_world

VERSION = 2                      # 2: tags in TAG_FRAME at every size (1: in the render's pixels)
CULL_SIZE = (480, 270)           # visibility is decided at this size, whatever the output size
MIN_VISIBLE_FRACTION = 0.5       # of the object's unoccluded footprint in its own camera
MIN_PIXELS = {"traffic light": 6, "pedestrian": 20}   # body pixels at CULL_SIZE
MIN_PIXELS_DEFAULT = 30
JPEG_QUALITY = 92
# Capture times of scenes in motion: scene i starts at SEQUENCE_EPOCH_US + i * SCENE_SPACING_US (a
# 2023 date, so stamps have nuScenes' 16 digits), its steps `stride` apart.
SEQUENCE_EPOCH_US = 1_700_000_000_000_000
SCENE_SPACING_US = 100_000_000
MAX_FRAMES = 16
MAX_WINDOW_S = 60.0               # (frames - 1) * stride: a scene's steps stay within its spacing


def token(*parts) -> str:
    """A nuScenes-looking 32-hex token, deterministic in its parts."""
    return hashlib.md5("/".join(str(p) for p in parts).encode()).hexdigest()


@dataclass
class View:
    """Where an object shows in one camera at the output size."""
    centre: tuple[float, float]   # a pixel of its body (paint, shirt, lit lamp), nearest its centroid
    bbox: tuple[float, float, float, float]
    pixels: int


def _mask_stats(mask: np.ndarray, n_objects: int) -> np.ndarray:
    return np.bincount(mask.ravel(), minlength=2 * n_objects + 2)


def cull(world: World) -> None:
    """Drop objects a viewer could not make out: too small, or mostly hidden behind others, in
    the camera whose sector holds them. Dropping only ever uncovers others, so one pass does."""
    cams = rig(*CULL_SIZE)
    blank = np.zeros((CULL_SIZE[1], CULL_SIZE[0], 3), np.uint8)
    counts = {name: _mask_stats(render(world, cam, blank, road=False)[1], len(world.objects))
              for name, cam in cams.items()}
    keep = []
    for i, obj in enumerate(world.objects):
        cam = sector_camera(obj.bearing)
        body, detail = counts[cam][2 * i + 1], counts[cam][2 * i + 2]
        if body < MIN_PIXELS.get(obj.kind, MIN_PIXELS_DEFAULT):
            continue
        footprint = np.count_nonzero(render_alone(world, cams[cam], i))
        if footprint == 0 or (body + detail) / footprint < MIN_VISIBLE_FRACTION:
            continue
        keep.append(obj)
    world.objects = keep
    decide_ego(world)


def _views(mask: np.ndarray, n_objects: int) -> dict[int, View]:
    # One pass over the drawn pixels, grouped by mask value (a stable sort keeps each object's
    # pixels in row-major order, as np.nonzero(mask == v) gives them): a comparison of the whole
    # mask per object made 1600x900 masks the slowest part of generating a scene.
    ys, xs = np.nonzero(mask)
    values = mask[ys, xs]
    order = np.argsort(values, kind="stable")
    ys, xs = ys[order], xs[order]
    start = np.searchsorted(values[order], np.arange(2 * n_objects + 3))   # first pixel of each value
    out = {}
    for i in range(n_objects):
        body, rest, end = start[2 * i + 1], start[2 * i + 2], start[2 * i + 3]
        if rest == body:
            continue
        bx, by = xs[body:rest], ys[body:rest]
        cx, cy = bx.mean(), by.mean()
        # The body pixel nearest the body's centroid: the centroid itself can fall on a window or
        # between a pedestrian's legs, a tag must point at the object's own colour.
        k = int(np.argmin((bx - cx) ** 2 + (by - cy) ** 2))
        ax, ay = xs[body:end], ys[body:end]
        out[i] = View((float(bx[k]) + 0.5, float(by[k]) + 0.5),
                      (float(ax.min()), float(ay.min()), float(ax.max()) + 1, float(ay.max()) + 1),
                      int(end - body))
    return out


def capture_times_us(index: int, frames: int, stride_us: int) -> list[int]:
    """The capture times of scene `index`'s steps in motion, oldest first (the key frame last)."""
    start = SEQUENCE_EPOCH_US + index * SCENE_SPACING_US
    return [start + k * stride_us for k in range(frames)]


def build_scene(seed: int, index: int, width: int, height: int, out_dir: str | None, frames: int = 1,
                stride_us: int = 500_000) -> dict:
    """Sample, cull, render and describe scene `index`; write its JPEGs when out_dir is given.
    frames > 1: the scene in motion, rendered at `frames` steps `stride_us` microseconds apart."""
    rng = np.random.default_rng([seed, index])
    world = sample_world(rng)
    steps = motion.times(frames, stride_us)
    if frames > 1:            # its own stream: the layout is the single-frame scene's
        motion.assign(world, np.random.default_rng([seed, index, 3]), steps)
    cull(world)
    in_motion = ("frames", frames, "stride_us", stride_us) if frames > 1 else ()
    if frames > 1:
        motion.settle(world, steps)
    scene_token = token("synthdrive", VERSION, seed, index, "scene", *in_motion)
    frame_token = token("synthdrive", VERSION, seed, index, "frame", *in_motion)
    stamps = capture_times_us(index, frames, stride_us)
    cams = rig(width, height)
    base = background(world, width, height)
    views: dict[str, dict[int, View]] = {}
    image_paths = {}
    images = {}
    sequence = []                     # in motion: every step's {camera: (path, image)}, oldest first
    for step in range(frames):
        shown = motion.snapshot(world, step, steps) if frames > 1 else world
        key = step == frames - 1
        at_step = {}
        for name in CAMERAS:
            image, mask = render(shown, cams[name], base.copy())
            if frames > 1:
                rel = f"samples/{name}/synthdrive-s{seed}-{index:06d}__{name}__{stamps[step]:016d}.jpg"
            else:
                rel = f"samples/{name}/synthdrive-s{seed}-{index:06d}__{name}.jpg"
            if key:
                views[name] = _views(mask, len(world.objects))
                image_paths[name] = rel
                images[name] = image
            at_step[name] = (rel, image)
            if out_dir is not None:
                path = Path(out_dir) / rel
                image.save(path, format="JPEG", quality=JPEG_QUALITY, subsampling=0)
        if frames > 1:
            sequence.append(at_step)
    if (width, height) == TAG_FRAME:
        tag_views = views
    else:                              # the QA's views: the object masks of a render at TAG_FRAME
        tag_cams, blank = rig(*TAG_FRAME), np.zeros((TAG_FRAME[1], TAG_FRAME[0], 3), np.uint8)
        tag_views = {name: _views(render(world, tag_cams[name], blank.copy(), road=False)[1], len(world.objects))
                     for name in CAMERAS}
    objects, rendered = [], []          # (object, camera, views) in TAG_FRAME for the QA; views in this render
    for i, obj in enumerate(world.objects):
        seen_in = {cam: tag_views[cam][i] for cam in CAMERAS if i in tag_views[cam]}
        primary = sector_camera(obj.bearing)
        if primary not in seen_in:
            if not seen_in:
                continue
            primary = max(seen_in, key=lambda c: seen_in[c].pixels)
        objects.append((obj, primary, seen_in))
        rendered.append({cam: views[cam][i] for cam in CAMERAS if i in views[cam]})
    qa_rng = np.random.default_rng([seed, index, 1])
    frame, tags = frame_qa(world, objects, qa_rng, frames)
    frame["image_paths"] = image_paths
    if frames > 1:
        frame["timestamp"] = stamps[-1]
    gt_objects = []
    for (obj, primary, _), seen_in in zip(objects, rendered):
        gt_objects.append({
            "id": tags.get(id(obj)), "kind": obj.kind, "colour": obj.colour, "status": obj.status,
            "observed_status": obj.observed_status, "moving": obj.moving, "place": obj.place,
            "distance_m": round(obj.distance, 2), "bearing_deg": round(obj.bearing, 1),
            "x": round(obj.x, 3), "y": round(obj.y, 3), "s": round(obj.s, 3), "d": round(obj.d, 3),
            "yaw_deg": round(float(np.degrees(obj.yaw)), 2), "camera": primary,
            "cameras": {cam: {"centre": [round(v.centre[0], 1), round(v.centre[1], 1)],
                              "bbox": [round(b, 1) for b in v.bbox], "pixels": v.pixels}
                        for cam, v in seen_in.items()},
        } | (_motion_truth(obj) if frames > 1 else {}))
    road = world.road
    ground_truth = {
        "scene_token": scene_token, "index": index,
        "ego": {"speed": world.ego_speed, "direction": world.ego_direction, "behaviour": world.behaviour,
                "light_state": world.light_state},
        "road": {"lanes_same_direction": road.n_same, "lanes_oncoming": road.n_opposite, "ego_lane": road.ego_lane,
                 "curvature": road.curvature, "crosswalk_s": road.crosswalk_s, "stop_line_s": road.stop_line_s},
        "image_size": [width, height],
        "objects": gt_objects,
    }
    if frames > 1:
        ground_truth["ego"] |= {"speed_mps": motion.EGO_SPEED_MPS[world.ego_speed],
                                "track": [{"t_s": t, "x": round(x, 3), "y": 0.0}
                                          for t, x in zip(steps, motion.ego_xs(world, steps))]}
        ground_truth |= {"frames": frames, "stride_s": stride_us / 1e6,
                         "sequence": [{"timestamp": stamp, "t_s": t,
                                       "image_paths": {cam: rel for cam, (rel, _) in at_step.items()}}
                                      for stamp, t, at_step in zip(stamps, steps, sequence)]}
    scene = {"scene_description": describe(world), "key_frames": {frame_token: frame}}
    return {"index": index, "scene_token": scene_token, "frame_token": frame_token, "scene": scene,
            "ground_truth": ground_truth,
            # In-memory callers (tests) get the world and images; workers writing files send neither back.
            "world": None if out_dir else world, "images": None if out_dir else images,
            "sequence": None if out_dir or frames == 1 else [{cam: im for cam, (_, im) in at_step.items()}
                                                             for at_step in sequence]}


def _motion_truth(obj) -> dict:
    """An object's motion in ground_truth.json: its labels and its pose at every step (key frame
    coordinates, oldest first), from which the labels are recomputed (motion.labels)."""
    m = obj.motion
    found = m.labels
    return {"motion": {"status": found.status, "moving": found.moving, "approaching": found.approaching,
                       "crosses_ego_lane": found.crosses_ego_lane, "closing_mps": round(found.closing_mps, 3),
                       "lateral_mps": round(found.lateral_mps, 3), "speed_mps": round(m.speed, 3),
                       "yaw_rate_deg_s": round(math.degrees(m.yaw_rate), 3)},
            "track": [{"t_s": p.t, "x": round(p.x, 4), "y": round(p.y, 4), "s": round(p.s, 4), "d": round(p.d, 4),
                       "yaw_deg": round(math.degrees(p.yaw), 4), "legs_apart": p.legs_apart} for p in m.poses]}


def describe(world: World) -> str:
    road = world.road
    lanes = f"{road.n_same} lane{'s' if road.n_same > 1 else ''} in its direction"
    oncoming = f" and {road.n_opposite} oncoming lane{'s' if road.n_opposite > 1 else ''}" if road.n_opposite else ""
    shape = "a straight road" if road.curvature == 0 else \
        f"a road bending to the {'left' if road.curvature > 0 else 'right'}"
    extras = []
    if world.light_state:
        extras.append(f"a {world.light_state} traffic light")
    if road.crosswalk_s is not None:
        extras.append("a zebra crossing")
    ahead = f", with {' and '.join(extras)} ahead" if extras else ""
    return f"The ego vehicle drives on {shape} with {lanes}{oncoming}{ahead}."


def _work(job):
    return build_scene(*job)


def scene_size(seed: int, index: int, sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """The size scene `index` is rendered at: one of `sizes`, from the scene's own RNG stream (so it
    depends on neither the scene count nor the workers, and leaves the scene's content alone)."""
    return sizes[int(np.random.default_rng([seed, index, 2]).integers(len(sizes)))] if len(sizes) > 1 else sizes[0]


@dataclass(frozen=True)
class SynthSpec:
    """What a SynthDrive set is (`litevlm synth`'s flags): `scenes` scenes from `seed`, rendered at
    width x height, or at one of `sizes` (width, height) drawn per scene (the same scenes and
    questions at mixed resolutions); `val_fraction` of the scenes in val.json; `frames` > 1: every
    scene in motion, at that many time steps `stride` seconds apart (module docstring). The same
    spec writes the same files, whatever the workers."""
    scenes: int
    seed: int
    width: int = 1600
    height: int = 900
    val_fraction: float = 0.1
    sizes: list[tuple[int, int]] | None = None
    frames: int = 1
    stride: float = 0.5


def generate(out_dir: str | Path, spec: SynthSpec, workers: int | None = None, progress: bool = True) -> dict:
    """Write the SynthDrive set `spec` describes into out_dir (train.json, val.json, ground_truth.json,
    the camera JPEGs) with `workers` processes (default: all cores); returns synthdrive.json's info."""
    scenes, seed, frames, stride, sizes, val_fraction = (spec.scenes, spec.seed, spec.frames, spec.stride,
                                                         spec.sizes, spec.val_fraction)
    if scenes < 1:
        raise InputError("--scenes must be at least 1")
    if not 1 <= frames <= MAX_FRAMES:
        raise InputError(f"--frames {frames}: expected 1 .. {MAX_FRAMES} time steps per scene")
    stride_us = round(stride * 1e6)
    if frames > 1 and not (stride_us >= 1000 and (frames - 1) * stride <= MAX_WINDOW_S):
        raise InputError(f"--stride {stride:g}: expected at least 0.001 s, and (frames - 1) x stride at most "
                         f"{MAX_WINDOW_S:g} s")
    sizes = list(sizes) if sizes else [(spec.width, spec.height)]
    for w, h in sizes:
        if w < 64 or h < 36 or w > 8192 or h > 8192:
            raise InputError(f"image size {w}x{h} out of range (64x36 .. 8192x8192)")
    if not 0.0 <= val_fraction < 1.0:
        raise InputError("--val-fraction must be in [0, 1)")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / "synthdrive.json").exists():
        raise InputError(f"{out} exists and is not a SynthDrive folder; choose an empty or new folder")
    for cam in CAMERAS:
        (out / "samples" / cam).mkdir(parents=True, exist_ok=True)
        for stale in (out / "samples" / cam).glob("synthdrive-*.jpg"):   # an earlier run into this folder
            stale.unlink()
    info = {"generator": "SynthDrive", "version": VERSION, "seed": seed, "scenes": scenes, "width": sizes[0][0],
            "height": sizes[0][1]} | ({"sizes": [f"{w}x{h}" for w, h in sizes]} if len(sizes) > 1 else {}) | \
           {"tag_frame": f"{TAG_FRAME[0]}x{TAG_FRAME[1]}", "complete": False} | \
           ({"frames": frames, "stride_s": stride_us / 1e6} if frames > 1 else {})
    (out / "synthdrive.json").write_text(json.dumps(info, indent=1))    # marks the folder as ours at once
    n_val = int(round(scenes * val_fraction))
    n_train = scenes - n_val
    workers = max(1, min(workers or os.cpu_count() or 1, scenes))
    jobs = [(seed, i, *scene_size(seed, i, sizes), str(out)) + ((frames, stride_us) if frames > 1 else ())
            for i in range(scenes)]
    train, val, truth = {}, {}, {}
    n_qa = {"train": 0, "val": 0}
    start = time.perf_counter()
    bar = tqdm(total=scenes, desc="synth", unit="scene", disable=not progress)
    pool = multiprocessing.Pool(workers) if workers > 1 else None
    try:
        results = pool.imap(_work, jobs, chunksize=4) if pool else map(_work, jobs)
        for result in results:            # in scene order: the JSON files do not depend on workers
            split = "train" if result["index"] < n_train else "val"
            (train if split == "train" else val)[result["scene_token"]] = result["scene"]
            gt = result["ground_truth"] | {"split": split}
            truth[result["frame_token"]] = gt
            for frame in result["scene"]["key_frames"].values():
                n_qa[split] += sum(len(v) for v in frame["QA"].values())
            bar.update(1)
    finally:
        bar.close()
        if pool:
            pool.close()
            pool.join()
    elapsed = time.perf_counter() - start
    (out / "train.json").write_text(json.dumps(train, indent=1))
    (out / "val.json").write_text(json.dumps(val, indent=1))
    (out / "ground_truth.json").write_text(json.dumps(truth, indent=1))
    info |= {"complete": True, "train_scenes": n_train, "val_scenes": n_val, "qa_train": n_qa["train"],
             "qa_val": n_qa["val"]}
    (out / "synthdrive.json").write_text(json.dumps(info, indent=1))
    return info | {"seconds": round(elapsed, 2), "workers": workers}
