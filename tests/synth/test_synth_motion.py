"""SynthDrive in motion (`litevlm synth --frames K --stride S`): the sequence on disk, motion labels
recomputed from the ground-truth positions at the K steps, one frame that does not give the
motion away, and the single-frame set left byte for byte as it was."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.evaluation.data import MOTION, frame_images_over_time, load_frames
from litevlm_runtime.evaluation.motion_sheet import sequence_sheet
from litevlm_runtime.frames import capture_us
from litevlm_runtime.synth import motion
from litevlm_runtime.synth.camera import rig
from litevlm_runtime.synth.generate import SynthSpec, build_scene, cull, generate
from litevlm_runtime.synth.render import render
from litevlm_runtime.synth.world import LANE_WIDTH, VEHICLE_KINDS, decide_ego, sample_world

SEED, SCENES, K, STRIDE, W, H = 43, 8, 4, 0.5, 320, 180
TAG = re.compile(r"<(c\d+),CAM_[A-Z_]+,[\d.]+,[\d.]+>")
DRIVELM_ITEM = {"Q", "A", "C", "con_up", "con_down", "cluster", "layer"}


@pytest.fixture(scope="module")
def motion_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("motion")
    generate(out, SynthSpec(SCENES, SEED, W, H, val_fraction=0.25, frames=K, stride=STRIDE), workers=1, progress=False)
    return out


def _key_frames(out: Path):
    for split in ("train", "val"):
        for scene_token, scene in json.loads((out / f"{split}.json").read_text()).items():
            for frame_token, frame in scene["key_frames"].items():
                yield scene_token, frame_token, frame


def test_sequence_layout_stamps_and_drivelm_items(motion_set):
    info = json.loads((motion_set / "synthdrive.json").read_text())
    assert info["frames"] == K and info["stride_s"] == STRIDE
    truth = json.loads((motion_set / "ground_truth.json").read_text())
    for cam in CAMERAS:
        files = sorted((motion_set / "samples" / cam).iterdir())
        assert len(files) == SCENES * K
        for scene in range(SCENES):
            prefix = f"synthdrive-s{SEED}-{scene:06d}__{cam}__"
            stamps = sorted(capture_us(p) for p in files if p.name.startswith(prefix))
            assert np.diff(stamps).tolist() == [round(STRIDE * 1e6)] * (K - 1)
    marked = 0
    for _, frame_token, frame in _key_frames(motion_set):
        gt = truth[frame_token]
        stamps = [s["timestamp"] for s in gt["sequence"]]
        assert frame["timestamp"] == stamps[-1] == capture_us(frame["image_paths"]["CAM_FRONT"])
        assert [s["t_s"] for s in gt["sequence"]] == [-(K - 1 - k) * STRIDE for k in range(K)]
        for items in frame["QA"].values():
            for item in items:
                assert set(item) in (DRIVELM_ITEM, DRIVELM_ITEM | {"frames"})
                assert item.get("frames", K) == K
                marked += "frames" in item
        for rel in frame["image_paths"].values():
            with Image.open(motion_set / rel) as im:
                assert im.size == (W, H)
    assert marked >= 4 * SCENES
    # The one DriveLM reader: marked questions are the motion category, and the key frame's time is read.
    frames = [f for split in ("train", "val") for f in load_frames(motion_set / f"{split}.json")]
    assert {q.category for f in frames for q in f.questions} == {"perception", "prediction", "planning",
                                                                 "behavior", MOTION}
    assert all((q.category == MOTION) == (q.frames == K) for f in frames for q in f.questions)
    assert all(f.timestamp_us == truth[f.token]["sequence"][-1]["timestamp"] for f in frames)


def test_loader_finds_each_key_frames_history_and_names_what_is_missing(motion_set):
    truth = json.loads((motion_set / "ground_truth.json").read_text())
    frames = load_frames(motion_set / "train.json")
    for frame in frames:
        sets = frame_images_over_time(motion_set, frame, K, STRIDE)
        gt = truth[frame.token]["sequence"]
        assert [s.offset_s for s in sets] == [-(K - 1 - k) * STRIDE for k in range(K)]
        assert [s.stamp_us for s in sets] == [g["timestamp"] for g in gt]
        assert [{c: p.relative_to(motion_set).as_posix() for c, p in s.paths.items()} for s in sets] == \
            [g["image_paths"] for g in gt]
    frame = frames[0]
    assert len(frame_images_over_time(motion_set, frame, 1, STRIDE)) == 1
    with pytest.raises(InputError, match=r"CAM_FRONT: no frame at time step t-4 \(-2 s"):
        frame_images_over_time(motion_set, frame, K + 1, STRIDE)
    with pytest.raises(InputError, match=r"CAM_FRONT: no frame at time step t-1 \(-0.3 s"):
        frame_images_over_time(motion_set, frame, 2, 0.3)       # 0.5 s apart: nothing within 0.075 s of -0.3 s
    assert len(frame_images_over_time(motion_set, frame, 2, 0.3, tolerance_s=0.25)) == 2
    # One camera's file of one earlier step gone: that camera and that step are named.
    gone = motion_set / truth[frame.token]["sequence"][1]["image_paths"]["CAM_BACK_LEFT"]
    saved = gone.read_bytes()
    gone.unlink()
    try:
        with pytest.raises(InputError, match=rf"frame {frame.token}: CAM_BACK_LEFT: no frame at time step t-2 "
                                             r"\(-1 s"):
            frame_images_over_time(motion_set, frame, K, STRIDE)
    finally:
        gone.write_bytes(saved)


# -- labels from positions ------------------------------------------------------------------------

def _recomputed(obj: dict, ego: list[dict], curvature: float) -> dict:
    """The motion labels from the ground-truth poses alone, written here independently of motion.py."""
    track = obj["track"]
    a, b = track[0], track[-1]
    span = b["t_s"] - a["t_s"]
    moving = math.hypot(b["x"] - a["x"], b["y"] - a["y"]) / span > 0.5
    out = {"moving": moving}
    turn = 0.0
    if obj["kind"] in VEHICLE_KINDS:
        rel = [math.radians(p["yaw_deg"]) - curvature * max(p["s"], 0.0) for p in (a, b)]
        turn = math.degrees(math.atan2(math.sin(rel[1] - rel[0]), math.cos(rel[1] - rel[0]))) / span
        out["status"] = "turn left" if turn > 8 else "turn right" if turn < -8 else \
            "going ahead" if moving else "stopped"
    elif obj["kind"] == "pedestrian":
        out["status"] = "walking" if moving else "standing"
    closing = (math.hypot(b["x"] - ego[-1]["x"], b["y"]) - math.hypot(a["x"] - ego[0]["x"], a["y"])) / span
    out["approaching"] = True if closing < -1.5 else False if (closing > 1.5 or abs(closing) < 1.0) else None
    # Going on as the last step and the window's turn show, in small time steps (not the closed form).
    c = track[-2]
    step = b["t_s"] - c["t_s"]
    speed = math.hypot(b["s"] - c["s"], b["d"] - c["d"]) / step
    rate = 0.0
    if obj["kind"] in VEHICLE_KINDS:
        rate = math.radians(turn) if abs(turn) > 1e-9 else 0.0
    course = math.atan2(b["d"] - c["d"], b["s"] - c["s"]) + rate * step / 2
    d, path = b["d"], [b["d"]]
    for i in range(3000):                     # 3 s in 1 ms steps, midpoint rule
        d += 0.001 * speed * math.sin(course + rate * 0.001 * (i + 0.5))
        path.append(d)
    if abs(b["d"]) < LANE_WIDTH / 2:
        lateral = speed * math.sin(course)
        out["crosses_ego_lane"] = True if abs(lateral) >= 0.5 else False if abs(lateral) < 0.1 else None
    else:
        nearest = min(abs(x) for x in path)
        out["crosses_ego_lane"] = True if nearest < LANE_WIDTH / 2 - 0.3 else \
            False if nearest >= LANE_WIDTH / 2 + 0.3 else None
    return out


def _chosen(question: str, letter: str) -> str:
    options = dict(re.findall(r"([A-D])\. ([^.]+\.)", question.split("options:")[1]))
    return options[letter]


def test_labels_are_recomputed_from_the_positions_at_the_k_steps(motion_set):
    truth = json.loads((motion_set / "ground_truth.json").read_text())
    checked = {"moving": 0, "status": 0, "approaching": 0, "crossing": 0, "do_next": 0}
    statuses = set()
    for _, frame_token, frame in _key_frames(motion_set):
        gt = truth[frame_token]
        ego, curvature = gt["ego"]["track"], gt["road"]["curvature"]
        assert [e["x"] for e in ego] == pytest.approx([gt["ego"]["speed_mps"] * e["t_s"] for e in ego], abs=1e-3)
        by_id = {}
        for obj in gt["objects"]:
            assert len(obj["track"]) == K
            again = _recomputed(obj, ego, curvature)
            for name, value in again.items():
                assert obj["motion"][name] == value, (frame_token, obj["id"], name)
            if obj["kind"] in VEHICLE_KINDS + ("pedestrian",):
                assert obj["status"] == again["status"]
                statuses.add(again["status"])
            by_id[obj["id"]] = obj | {"again": again}
        for item in (i for items in frame["QA"].values() for i in items):
            q, a = item["Q"], item["A"]
            tag = TAG.search(q)
            obj = by_id.get(tag.group(1)) if tag else None
            if q.startswith("Is <") and q.endswith("> moving?"):
                assert a == ("Yes." if obj["again"]["moving"] else "No.") and item["frames"] == K
                checked["moving"] += 1
            elif q.startswith("What is the moving status of object"):
                assert _chosen(q, a) == {"going ahead": "Going ahead.", "turn left": "Turn left.",
                                         "turn right": "Turn right.", "stopped": "Stopped."}[obj["again"]["status"]]
                checked["status"] += 1
            elif "approaching the ego vehicle?" in q:
                assert a == ("Yes." if obj["again"]["approaching"] else "No.") and item["frames"] == K
                checked["approaching"] += 1
            elif "cross the lane of the ego vehicle?" in q:
                assert a == ("Yes." if obj["again"]["crosses_ego_lane"] else "No.") and item["frames"] == K
                checked["crossing"] += 1
            elif q.startswith("What should the ego vehicle do next?"):
                lead = min((o for o in by_id.values() if o["kind"] in VEHICLE_KINDS and o["place"] == "ego lane"
                            and 0 < o["s"] < 40.0), key=lambda o: o["s"])
                m = lead["again"]
                closing = lead["motion"]["closing_mps"]
                want = (("Stop." if lead["s"] < 20 else "Slow down.") if not m["moving"] else
                        "Slow down." if closing < -1.5 else "Keep going at the same speed." if abs(closing) < 1.0
                        else "Speed up.")
                assert _chosen(q, a) == want
                checked["do_next"] += 1
    assert checked["moving"] >= SCENES and checked["status"] >= SCENES and checked["approaching"] >= 2
    assert checked["crossing"] >= 2 and checked["do_next"] >= 1
    assert {"stopped", "walking", "standing"} <= statuses and statuses & {"going ahead", "turn left", "turn right"}


# -- one frame does not give the motion away ----------------------------------------------------

def test_the_key_frame_looks_the_same_whatever_the_objects_do():
    """Rewrite what every object does (moving <-> stopped, parked or not, walking <-> standing)
    and the key frame renders pixel for pixel the same: only poses and looks drawn alike for every
    motion reach the renderer. A single-frame scene fails this (lamps lit when stopped, legs apart
    when walking), which shows the check can fail."""
    flips = {"going ahead": "stopped", "turn left": "stopped", "turn right": "stopped", "stopped": "going ahead",
             "walking": "standing", "standing": "walking"}
    cams = rig(240, 135)
    for index in range(3):
        scene = build_scene(SEED, index, 240, 135, None, frames=K, stride_us=500_000)
        world = scene["world"]
        assert any(o.kind in VEHICLE_KINDS + ("pedestrian",) for o in world.objects)
        other = copy.deepcopy(world)
        for obj in other.objects:
            if obj.status in flips:
                obj.status, obj.parked = flips[obj.status], not obj.parked
        for name in CAMERAS:
            assert np.array_equal(np.asarray(render(world, cams[name])[0]), np.asarray(render(other, cams[name])[0]))
    single = sample_world(np.random.default_rng([SEED, 0]))
    cull(single)
    flipped = copy.deepcopy(single)
    for obj in flipped.objects:
        if obj.status in flips:
            obj.status, obj.parked = flips[obj.status], False
    assert any(not np.array_equal(np.asarray(render(single, cams[n])[0]), np.asarray(render(flipped, cams[n])[0]))
               for n in CAMERAS)


# p = 0.001 critical values of chi-square by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 8: 26.12, 9: 27.88, 12: 32.91}


def _chi2(pairs: list[tuple]) -> tuple[float, int]:
    """Pearson's chi-square of independence of a contingency table of (feature, label) pairs."""
    rows = sorted({f for f, _ in pairs}, key=str)
    cols = sorted({lab for _, lab in pairs}, key=str)
    table = np.zeros((len(rows), len(cols)))
    for f, lab in pairs:
        table[rows.index(f), cols.index(lab)] += 1
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), (len(rows) - 1) * (len(cols) - 1)


def _single_frame_features(world) -> list[tuple[str, tuple, str]]:
    """(what, the look one frame shows, the motion label) per vehicle and pedestrian: heading
    against the lane (2-degree bins), lamps, place; legs, place."""
    out = []
    for o in world.objects:
        if o.kind in VEHICLE_KINDS:
            base = math.pi if (o.place == "oncoming lane" or (o.place == "parking" and o.d > 0)) else 0.0
            rel = math.degrees(math.atan2(math.sin(o.yaw - world.road.heading(o.s) - base),
                                          math.cos(o.yaw - world.road.heading(o.s) - base)))
            lamps = o.brake_lamps if o.brake_lamps is not None else (o.status == "stopped" and not o.parked)
            out += [("vehicle heading", min(int(abs(rel) // 2), 3), o.status), ("vehicle lamps", lamps, o.status),
                    ("vehicle place", o.place == "parking", o.status)]
        elif o.kind == "pedestrian":
            legs = o.legs_apart if o.legs_apart is not None else o.status == "walking"
            out += [("pedestrian legs", legs, o.status), ("pedestrian place", o.place, o.status)]
    return out


def test_what_one_frame_shows_is_independent_of_the_motion_label():
    """Over 300 scenes in motion (drawn and settled as the generator does, without rendering), no
    single-frame feature of a vehicle or pedestrian depends on what it does (chi-square, p > 0.001);
    the same features of single-frame scenes do, which is what the motion set removes."""
    steps = motion.times(K, 500_000)
    in_motion, single = [], []
    for index in range(300):
        world = sample_world(np.random.default_rng([7, index]))
        single += _single_frame_features(world)
        world = sample_world(np.random.default_rng([7, index]))
        motion.assign(world, np.random.default_rng([7, index, 3]), steps)
        decide_ego(world)
        motion.settle(world, steps)
        in_motion += _single_frame_features(world)
    for what in ("vehicle heading", "vehicle lamps", "vehicle place", "pedestrian legs", "pedestrian place"):
        pairs = [(f, lab) for w, f, lab in in_motion if w == what]
        assert len(pairs) > 200
        stat, df = _chi2(pairs)
        if df:
            assert stat < CHI2_999[df], (what, stat, df)
    for what in ("vehicle heading", "vehicle lamps", "pedestrian legs"):
        stat, df = _chi2([(f, lab) for w, f, lab in single if w == what])
        assert df and stat > CHI2_999[df], (what, stat, df)


def _off_axis(point: np.ndarray) -> float:
    """How far from a camera's optical axis a point in its coordinates is (tan squared; behind: huge)."""
    return point[0] ** 2 / point[2] ** 2 if point[2] > 0 else 1e9


def test_objects_drawn_where_their_tracks_say_at_every_step():
    """At every step, the centre of a tagged object's ground-truth pose projects onto that object in
    the frame rendered for the step (its mask), in the camera it is seen in, unless something
    nearer covers it: the sequence and the positions the labels come from agree."""
    hits = total = 0
    cams = rig(480, 270)
    steps = motion.times(K, 500_000)
    for index in range(4):
        scene = build_scene(SEED, index, 480, 270, None, frames=K, stride_us=500_000)
        world, gt = scene["world"], scene["ground_truth"]
        assert len(scene["sequence"]) == K
        for i, obj in enumerate(world.objects):
            if obj.kind not in VEHICLE_KINDS + ("pedestrian",):
                continue
            for k in range(K):
                shown = motion.snapshot(world, k, steps)
                ego_x = gt["ego"]["track"][k]["x"]
                p = obj.motion.poses[k]
                centre = np.array([[p.x - ego_x, p.y, obj.size[2] / 2]])
                cam = min(CAMERAS, key=lambda c: _off_axis(cams[c].to_camera(centre)[0]))
                point = cams[cam].to_camera(centre)
                if point[0, 2] < 2.0:
                    continue
                u, v = cams[cam].project(point)[0]
                if not (0 <= u < 480 and 0 <= v < 270):
                    continue
                mask = render(shown, cams[cam], road=False)[1]
                total += 1
                hits += mask[int(v), int(u)] in (2 * i + 1, 2 * i + 2)
    assert total >= 30 and hits / total > 0.85, (hits, total)


def test_sheet_shows_the_sequence(motion_set, tmp_path):
    out = sequence_sheet(motion_set, tmp_path / "sheet.png", scene=1, tile_width=160)
    with Image.open(out) as im:
        assert im.width == 160 * K and im.height > 6 * 90
    with pytest.raises(InputError, match="no scene 99"):
        sequence_sheet(motion_set, tmp_path / "x.png", scene=99)


# -- arguments and the single-frame set ----------------------------------------------------------

def test_bad_motion_arguments(tmp_path):
    with pytest.raises(InputError, match="--frames 17"):
        generate(tmp_path / "a", SynthSpec(1, 0, 160, 90, frames=17), progress=False)
    with pytest.raises(InputError, match="--stride 0"):
        generate(tmp_path / "b", SynthSpec(1, 0, 160, 90, frames=2, stride=0.0), progress=False)
    with pytest.raises(InputError, match="--stride 30"):
        generate(tmp_path / "c", SynthSpec(1, 0, 160, 90, frames=4, stride=30.0), progress=False)


# sha256 of train.json and ground_truth.json of `generate(out, SynthSpec(6, 2029, 480, 270), workers=2)`, as made
# by the tree before SynthDrive learnt motion (2813168): a single-frame set is unchanged by it. (Tags
# and culling follow PIL's rasterization: a Pillow that fills polygons differently changes them too.)
SINGLE_FRAME_2029 = {
    "train.json": "46530974ca7b80507f3316c3ba03afe1eacb3fd0243cfc3e63b6ebd20c4f2852",
    "ground_truth.json": "220d32319972995c48373c24cc7bd8e4f5dc2ce9532db78a777375b9ff304c84",
}


def test_single_frame_set_is_byte_for_byte_what_it_was(tmp_path):
    generate(tmp_path / "s", SynthSpec(6, 2029, 480, 270), workers=2, progress=False)
    for name, digest in SINGLE_FRAME_2029.items():
        assert hashlib.sha256((tmp_path / "s" / name).read_bytes()).hexdigest() == digest, name
    assert not any(capture_us(p) for p in (tmp_path / "s" / "samples").rglob("*.jpg"))


def test_one_frame_baseline_reads_only_what_one_frame_shows(motion_set):
    """The one-frame baseline (evaluation/one_frame.py) answers every closed-form motion question from
    key-frame facts that hold no motion (no status, speed or track), and counts every one."""
    from litevlm_runtime.evaluation.one_frame import compare, motion_rows

    rows = motion_rows(motion_set)
    frames = [f for split in ("train", "val") for f in load_frames(motion_set / f"{split}.json")]
    assert len(rows) == sum(q.category == MOTION and 0 in q.tags for f in frames for q in f.questions) > 0
    shown = {value for _, facts, *_ in rows for value in facts.values()}
    assert not shown & {"moving", "stopped", "going ahead", "turn left", "turn right", "walking", "standing"}
    pytest.importorskip("sklearn")
    table = compare(motion_set, motion_set)
    assert table[-1]["questions"] == len(rows) == sum(r["questions"] for r in table[:-1])
