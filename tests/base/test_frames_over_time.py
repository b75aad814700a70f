"""Frame sets over time (frames.py): a key frame's earlier frame sets found by the capture times in
nuScenes-style file names, the DriveLM sample's consecutive key frames in time order with their
real capture times, and the DriveLM reader's two additions for time ("timestamp", "frames")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.evaluation.data import MOTION, frame_images_over_time, load_frames
from litevlm_runtime.frames import capture_us, frames_over_time, scene_of, sequences

OFFSET_US = {cam: 7_000 * i for i, cam in enumerate(CAMERAS)}     # cameras fire apart, as nuScenes' do


def _stamped_folder(root: Path, scenes: dict[str, list[int]], drop: tuple[str, int] | None = None) -> Path:
    """samples/CAM_X/<scene>__CAM_X__<us>.jpg for every scene's frame times (microseconds)."""
    for cam in CAMERAS:
        (root / "samples" / cam).mkdir(parents=True, exist_ok=True)
        for scene, times in scenes.items():
            for k, t in enumerate(times):
                if drop == (cam, k):
                    continue
                Image.new("RGB", (32, 18), (k * 30, 0, 0)).save(
                    root / "samples" / cam / f"{scene}__{cam}__{t + OFFSET_US[cam]:016d}.jpg")
    return root


def _key(root: Path, scene: str, t: int) -> dict[str, Path]:
    return {cam: root / "samples" / cam / f"{scene}__{cam}__{t + OFFSET_US[cam]:016d}.jpg" for cam in CAMERAS}


def test_earlier_sets_by_capture_time_per_camera(tmp_path):
    # Scene A at 2 Hz with jitter, scene B interleaved in time in the same folders (another log).
    a = [1_600_000_000_000_000 + 500_000 * k + j for k, j in enumerate((0, 12_000, -9_000, 4_000, 0))]
    b = [t + 250_000 for t in a]
    root = _stamped_folder(tmp_path, {"logA": a, "logB": b})
    sets = frames_over_time(_key(root, "logA", a[-1]), 4, 0.5)
    assert [s.offset_s for s in sets] == [-1.5, -1.0, -0.5, 0.0]
    for s, t in zip(sets, a[1:]):
        assert s.stamps_us == {cam: t + OFFSET_US[cam] for cam in CAMERAS}
        assert all(scene_of(p) == "logA" and capture_us(p) == s.stamps_us[c] for c, p in s.paths.items())
        assert s.stamp_us == t + max(OFFSET_US.values())
    assert [s.paths["CAM_FRONT"].name for s in frames_over_time(_key(root, "logB", b[2]), 3, None)] == \
        [f"logB__CAM_FRONT__{t:016d}.jpg" for t in b[:3]]
    # The scene begins 2 s before its last frame: nothing at -2.5 s (the nearest is its first, at -2 s);
    # a tolerance tighter than the jitter refuses the frame at -1.009 s.
    assert len(frames_over_time(_key(root, "logA", a[-1]), 5, 0.5)) == 5
    with pytest.raises(InputError, match=r"CAM_FRONT: no frame at time step t-5 \(-2.5 s.*its nearest is at -2.000 s"):
        frames_over_time(_key(root, "logA", a[-1]), 6, 0.5)
    with pytest.raises(InputError, match=r"CAM_FRONT: no frame at time step t-2 \(-1 s .* within 0.005 s"):
        frames_over_time(_key(root, "logA", a[-1]), 4, 0.5, tolerance_s=0.005)


def test_the_missing_camera_and_time_step_are_named(tmp_path):
    times = [1_600_000_000_000_000 + 500_000 * k for k in range(4)]
    root = _stamped_folder(tmp_path, {"log": times}, drop=("CAM_BACK_RIGHT", 1))
    assert len(frames_over_time(_key(root, "log", times[-1]), 2, 0.5)) == 2
    with pytest.raises(InputError, match=r"^CAM_BACK_RIGHT: no frame at time step t-2 \(-1 s = 2 x stride 0.5 s"):
        frames_over_time(_key(root, "log", times[-1]), 4, 0.5)
    with pytest.raises(InputError, match="CAM_BACK_RIGHT"):
        sequences(root)                  # 3 files against the others' 4
    unstamped = {cam: tmp_path / f"{cam}.jpg" for cam in CAMERAS}
    assert frames_over_time(unstamped, 1)[0].stamp_us is None     # one frame set needs no time
    with pytest.raises(InputError, match="CAM_FRONT: CAM_FRONT.jpg has no capture time in its name"):
        frames_over_time(unstamped, 2)
    with pytest.raises(InputError, match="stride 0 s"):
        frames_over_time(_key(root, "log", times[-1]), 2, 0.0)


def test_drivelm_sample_key_frames_in_time_order_with_their_capture_times(drivelm_dir):
    """The real-frame check: the sample's n008 scene (4 key frames with QA, listed out of time order
    in its JSON) and n015 (5 key frames, no QA) come out in time order, each camera with the
    capture time its nuScenes file name carries; its key frames are 3 to 5.5 s apart, not 0.5 s,
    so a 0.5 s stride finds nothing and says so, while stride None takes the key frames before."""
    seqs = sequences(drivelm_dir / "samples")
    n008 = seqs["n008-2018-09-18-13-10-39-0400"]
    assert [len(v) for v in seqs.values()] == [4, 5]
    front = [s.stamps_us["CAM_FRONT"] for s in n008]
    assert front == [1537291002262404, 1537291005162404, 1537291010612404, 1537291013612404]
    assert n008[0].stamps_us["CAM_BACK"] == 1537291002287558
    for s in n008 + seqs["n015-2018-08-03-15-00-36+0800"]:
        assert all(capture_us(p) == s.stamps_us[c] and p.is_file() for c, p in s.paths.items())
        assert max(s.stamps_us.values()) - min(s.stamps_us.values()) < 100_000    # one sweep of the rig
    for seq in seqs.values():
        assert [s.offset_s for s in seq] == sorted(s.offset_s for s in seq) and seq[-1].offset_s == 0.0
    frames = load_frames(drivelm_dir / "qa_scene_n008.json")
    in_file = [f.timestamp_us for f in frames]
    assert in_file != sorted(in_file) and sorted(in_file) == front
    last = max(frames, key=lambda f: f.timestamp_us)
    history = frame_images_over_time(drivelm_dir, last, 4, None)
    assert [s.stamps_us for s in history] == [s.stamps_us for s in n008]
    assert [round(s.offset_s, 2) for s in history] == [-11.35, -8.45, -3.0, 0.0]
    with pytest.raises(InputError, match=rf"frame {last.token}: CAM_FRONT: no frame at time step t-1 \(-0.5 s"):
        frame_images_over_time(drivelm_dir, last, 2, 0.5)
    assert {q.category for f in frames for q in f.questions} <= {"perception", "prediction", "planning", "behavior"}


def _qa_file(tmp_path: Path, item_extra: dict, frame_extra: dict) -> Path:
    item = {"Q": "Is <c1,CAM_FRONT,10.0,20.0> moving?", "A": "Yes."} | item_extra
    frame = {"QA": {"perception": [{"Q": "What is there?", "A": "A car."}], "prediction": [item]},
             "image_paths": {"CAM_FRONT": "samples/CAM_FRONT/log__CAM_FRONT__1600000000000123.jpg"}} | frame_extra
    path = tmp_path / "qa.json"
    path.write_text(json.dumps({"scene": {"key_frames": {"frame": frame}}}))
    return path


def test_reader_reads_time_additions_and_refuses_bad_ones(tmp_path):
    frame = load_frames(_qa_file(tmp_path, {"frames": 4}, {}))[0]
    assert frame.timestamp_us == 1600000000000123               # from CAM_FRONT's file name
    assert [(q.id, q.category, q.frames) for q in frame.questions] == [
        ("scene_frame_0", "perception", 1), ("scene_frame_1", MOTION, 4)]
    frame = load_frames(_qa_file(tmp_path, {"frames": 1}, {"timestamp": 42}))[0]
    assert frame.timestamp_us == 42 and frame.questions[1].category == "prediction"
    for extra, message in ((({"frames": 0}, {}), r"frame, prediction item 1: \"frames\" must be"),
                           (({"frames": "4"}, {}), r"\"frames\" must be"),
                           (({"frames": True}, {}), r"\"frames\" must be"),
                           (({}, {"timestamp": -5}), r"frame frame: \"timestamp\" must be microseconds"),
                           (({}, {"timestamp": 1.5}), r"\"timestamp\" must be")):
        with pytest.raises(InputError, match=message):
            load_frames(_qa_file(tmp_path, *extra))
