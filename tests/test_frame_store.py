"""Frame store matching rules (plain Python, no ROS)."""

import pytest

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.ros.frame_store import Frame, FrameMatchError, FrameStore

MS = 1_000_000
SKEW, AGE = 100 * MS, 1000 * MS


def add_set(store, t, offsets=None, skip=()):
    """One frame per camera at t (+ per-camera offset in ms), payload says which set it is."""
    for i, cam in enumerate(CAMERAS):
        if cam in skip:
            continue
        off = (offsets or {}).get(cam, i * 8) * MS      # nuScenes-like 8 ms spread per camera
        store.add(Frame(cam, t + off, payload=f"{cam}@{t}"))


def test_newest_complete_set_is_chosen():
    store = FrameStore(CAMERAS, SKEW, AGE)
    add_set(store, 1000 * MS)
    add_set(store, 1500 * MS)
    fs = store.match(1700 * MS)
    assert {f.payload for f in fs.frames.values()} == {f"{c}@{1500 * MS}" for c in CAMERAS}
    assert fs.skew_ns == 40 * MS


def test_no_frames_names_missing_cameras():
    store = FrameStore(CAMERAS, SKEW, AGE)
    with pytest.raises(FrameMatchError) as e:
        store.match(0)
    assert e.value.status == "no_frames"
    add_set(store, 0, skip=("CAM_BACK",))
    with pytest.raises(FrameMatchError) as e:
        store.match(100 * MS)
    assert e.value.status == "no_frames" and "CAM_BACK" in str(e.value) and "CAM_FRONT," not in str(e.value)


def test_stale_when_a_camera_stopped_then_recovers_when_it_returns():
    store = FrameStore(CAMERAS, SKEW, AGE)
    add_set(store, 0)
    add_set(store, 3000 * MS, skip=("CAM_BACK_LEFT",))       # CAM_BACK_LEFT went quiet
    with pytest.raises(FrameMatchError) as e:
        store.match(3200 * MS)
    assert e.value.status == "stale_frames" and "CAM_BACK_LEFT" in str(e.value)
    add_set(store, 3500 * MS)                                  # and came back
    fs = store.match(3700 * MS)
    assert fs.frames["CAM_BACK_LEFT"].payload == f"CAM_BACK_LEFT@{3500 * MS}"


def test_out_of_sync_when_no_set_fits_the_skew():
    store = FrameStore(CAMERAS, SKEW, AGE)
    offsets = {c: 0 for c in CAMERAS} | {"CAM_FRONT_LEFT": 300}    # 300 ms late camera
    add_set(store, 0, offsets)
    with pytest.raises(FrameMatchError) as e:
        store.match(500 * MS)
    assert e.value.status == "out_of_sync" and "CAM_" in str(e.value)


def test_older_synchronized_set_is_used_when_newest_frames_are_not():
    store = FrameStore(CAMERAS, SKEW, AGE)
    add_set(store, 0)
    # Newest frames: only CAM_FRONT has moved on; the previous complete set is still in sync.
    store.add(Frame("CAM_FRONT", 400 * MS, "front-new"))
    fs = store.match(500 * MS)
    assert fs.frames["CAM_FRONT"].payload == f"CAM_FRONT@{0}"


def test_out_of_order_frames_are_kept_in_stamp_order_and_duplicates_counted():
    store = FrameStore(["A", "B"], SKEW, AGE, history=3)
    for t in (300, 100, 200):
        store.add(Frame("A", t * MS, t))
    store.add(Frame("A", 300 * MS, "again"))
    store.add(Frame("B", 290 * MS, "b"))
    fs = store.match(400 * MS)
    assert fs.frames["A"].payload == "again"
    assert store.out_of_order["A"] == 2 and store.dropped["A"] == 1
    store.add(Frame("A", 50 * MS, "too old"))                 # older than the whole history
    assert store.dropped["A"] == 2 and store.depth()["A"] == 3


def test_frames_older_than_max_age_are_not_matched():
    store = FrameStore(CAMERAS, SKEW, AGE)
    add_set(store, 0)
    with pytest.raises(FrameMatchError) as e:
        store.match(1200 * MS)
    assert e.value.status == "stale_frames"
