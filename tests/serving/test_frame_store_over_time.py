"""The frame store over time (plain Python, no ROS, no model): a query's past frame sets matched by
their stamps, stride apart, with the same skew and clock rules as the newest set; each missing step
named with its camera and why; the new final sets the idle worker follows; the window check."""

import pytest

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.options import Temporal
from litevlm_runtime.serving.frame_store import Frame, FrameMatchError, FrameStore
from litevlm_runtime.serving.settings import ServerSettings, check_window, standing_questions

MS = 1_000_000
SKEW, AGE, STRIDE = 100 * MS, 1000 * MS, 500 * MS


def add_set(store, t, skip=(), spread=8, label=None):
    """One frame per camera around t (nuScenes-like: the cameras fire `spread` ms apart)."""
    for i, cam in enumerate(CAMERAS):
        if cam not in skip:
            store.add(Frame(cam, t + i * spread * MS, payload=f"{cam}@{label if label is not None else t}"),
                      now_ns=t + 100 * MS)


def stream(store, start_ms, stop_ms, period_ms, **kw):
    """A rig firing every period_ms from start_ms up to stop_ms (ms)."""
    for t in range(start_ms, stop_ms + 1, period_ms):
        add_set(store, t * MS, **kw)


def newest(fs) -> int:
    return fs.newest_ns // MS


def test_past_sets_are_the_sets_nearest_each_step_at_12_hz():
    store = FrameStore(CAMERAS, SKEW, AGE, window_ns=5000 * MS)
    stream(store, 0, 3000, 83)                 # 12 Hz, the cameras 8 ms apart within a set
    sets = store.match_over_time(3100 * MS, 3050 * MS, 4, STRIDE)
    assert len(sets) == 4
    key = sets[-1]
    assert newest(key) == 2988 + 40              # the newest set at or before the question's stamp
    for i, fs in enumerate(reversed(sets)):
        assert abs(newest(fs) - (newest(key) - 500 * i)) <= 42, (i, newest(fs))   # nearest: within half a period
        assert fs.skew_ns <= SKEW
    assert len({newest(fs) for fs in sets}) == 4 and [newest(fs) for fs in sets] == sorted(newest(fs) for fs in sets)
    # the stamps alone decide: asked again later (more frames since), the same sets
    stream(store, 3071, 4000, 83)
    again = store.match_over_time(4100 * MS, 3050 * MS, 4, STRIDE)
    assert [fs.frames for fs in again] == [fs.frames for fs in sets]


def test_a_2_hz_sequence_gives_its_own_sets():
    store = FrameStore(CAMERAS, SKEW, AGE)
    for k in range(6):
        add_set(store, (1000 + 500 * k) * MS, spread=0, label=k)
    sets = store.match_over_time(4000 * MS, 3700 * MS, 4, STRIDE)
    assert [fs.frames["CAM_BACK"].payload for fs in sets] == [f"CAM_BACK@{k}" for k in (2, 3, 4, 5)]
    assert store.match_over_time(4000 * MS, 3700 * MS, 1, STRIDE)[0].frames == sets[-1].frames


def test_a_missing_step_names_the_camera_and_the_set():
    store = FrameStore(CAMERAS, SKEW, AGE)
    for k in range(4):
        add_set(store, (1000 + 500 * k) * MS, spread=0, skip=("CAM_BACK_LEFT",) if k == 1 else ())
    with pytest.raises(FrameMatchError) as e:
        store.match_over_time(3000 * MS, 2600 * MS, 4, STRIDE)
    msg = str(e.value)
    assert e.value.status == "stale_frames" and msg.startswith("frame set t-2 (2 x temporal.stride_s 0.5 s = 1 s")
    assert "CAM_BACK_LEFT (its nearest -1.500 s)" in msg and "CAM_FRONT" not in msg
    assert len(store.match_over_time(3000 * MS, 2600 * MS, 2, STRIDE)) == 2     # t-1 is there


def test_before_the_first_frame_and_after_the_window():
    store = FrameStore(CAMERAS, SKEW, AGE, window_ns=900 * MS)
    add_set(store, 1000 * MS, spread=0)
    add_set(store, 1500 * MS, spread=0)
    with pytest.raises(FrameMatchError) as e:
        store.match_over_time(1600 * MS, 1550 * MS, 3, STRIDE)
    assert e.value.status == "no_frames" and "frame set t-2" in str(e.value) and "any camera" in str(e.value)
    for k in range(2, 6):
        add_set(store, (1000 + 500 * k) * MS, spread=0)
    with pytest.raises(FrameMatchError) as e:               # the 0.9 s window dropped what t-3 needs
        store.match_over_time(3600 * MS, 3550 * MS, 4, STRIDE)
    assert e.value.status == "too_old" and "frame set t-3" in str(e.value) and "frame_window_s 0.9" in str(e.value)


def test_out_of_sync_step():
    store = FrameStore(CAMERAS, SKEW, AGE)
    add_set(store, 1000 * MS, spread=0)
    for cam in CAMERAS:                     # the set before: one camera 150 ms off its siblings
        store.add(Frame(cam, (1550 if cam == "CAM_FRONT_LEFT" else 1400) * MS, payload=cam), now_ns=1600 * MS)
    add_set(store, 2000 * MS, spread=0)
    with pytest.raises(FrameMatchError) as e:
        store.match_over_time(2100 * MS, 2050 * MS, 2, STRIDE)
    assert e.value.status == "out_of_sync" and "frame set t-1" in str(e.value)


def test_new_final_sets_in_stamp_order():
    store = FrameStore(CAMERAS, SKEW, AGE)
    add_set(store, 1000 * MS, spread=0)
    add_set(store, 1500 * MS, spread=0)
    got = store.sets_after(0, 1600 * MS)
    assert [newest(fs) for fs in got] == [1000, 1500]
    assert store.sets_after(1500 * MS, 1600 * MS) == []
    # a set some camera has not sent on from is not final (a frame of it may still be in flight) ...
    add_set(store, 2000 * MS, spread=8)
    assert [newest(fs) for fs in store.sets_after(1500 * MS, 2100 * MS)] == []
    # ... until the rig fires again, or match_wait_s has passed on the node's clock
    assert [newest(fs) for fs in store.sets_after(1500 * MS, 2300 * MS, wait_ns=200 * MS)] == [2040]
    add_set(store, 2500 * MS, spread=8)
    assert 2040 in [newest(fs) for fs in store.sets_after(1500 * MS, 2600 * MS)]
    for fs in store.sets_after(0, 2600 * MS):        # each one is what a query stamped at its newest frame gets
        assert store.match(2600 * MS, fs.newest_ns).frames == fs.frames


def test_the_window_must_hold_max_frames_sets():
    check_window(ServerSettings(), Temporal())          # the shipped defaults agree: 5 s >= 4 x 0.5 s
    with pytest.raises(InputError) as e:
        check_window(ServerSettings(frame_window_s=1.5), Temporal(max_frames=4, stride_s=0.5))
    assert "frame_window_s 1.5" in str(e.value) and "temporal.max_frames 4" in str(e.value) \
        and "temporal.stride_s 0.5" in str(e.value)
    check_window(ServerSettings(frame_window_s=1.5), Temporal(max_frames=1))      # one frame set: no window needed
    with pytest.raises(InputError) as e:
        check_window(ServerSettings(max_skew_s=0.1), Temporal(stride_s=0.12))
    assert "temporal.stride_s 0.12" in str(e.value) and "max_skew_s 0.1" in str(e.value)
    with pytest.raises(InputError) as e:
        check_window(ServerSettings(standing_frames=5), Temporal(max_frames=4))
    assert "standing_frames 5" in str(e.value)


def test_standing_questions_are_name_colon_question():
    assert standing_questions(["ped_lane: Is there a pedestrian in the ego lane?", "red:Is the light red?"]) == {
        "ped_lane": "Is there a pedestrian in the ego lane?", "red": "Is the light red?"}
    for bad in ("no name here", "2fast: Is it?", "a-b: Is it?", "empty:  "):
        with pytest.raises(InputError) as e:
            ServerSettings(standing_questions=(bad,))
        assert repr(bad) in str(e.value)
    with pytest.raises(InputError, match="named twice"):
        standing_questions(["a: one?", "a: two?"])
