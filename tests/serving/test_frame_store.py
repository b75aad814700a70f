"""Frame store matching rules (plain Python, no ROS)."""

import pytest

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.serving.frame_store import Frame, FrameMatchError, FrameStore

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


# ---- clock faults: stamps are the camera's clock, ages the node's (the store's clock_ns) ----
class Clock:
    def __init__(self, t_ns: int):
        self.t = t_ns

    def __call__(self) -> int:
        return self.t


def test_frames_stamped_ahead_of_the_node_clock_are_refused_and_counted_per_camera():
    clock = Clock(10_000 * MS)
    store = FrameStore(CAMERAS, SKEW, AGE, max_future_ns=500 * MS, clock_ns=clock)
    add_set(store, 10_000 * MS)                               # good frames first
    for step in range(3):                                    # then every camera +5 s ...
        clock.t += 100 * MS
        add_set(store, clock.t + 5000 * MS)
    assert store.bad_stamp == {c: 3 for c in CAMERAS} and store.received == {c: 4 for c in CAMERAS}
    # ... and stopped. The last good set serves while it is fresh; the future frames never do
    # (they had a negative age and were answered ok for 4.5 s after the cameras stopped); the
    # diagnosis names the cameras and how far ahead they were.
    assert store.match(10_400 * MS).frames["CAM_FRONT"].stamp_ns == 10_000 * MS
    for later in (1100, 4500):
        with pytest.raises(FrameMatchError) as e:
            store.match(10_000 * MS + later * MS)
        assert e.value.status == "bad_stamp", later
        assert "CAM_FRONT 5.000 s" in str(e.value) and "max_future 0.500 s" in str(e.value)
    # Once those stamps are no longer ahead (CAM_FRONT's last: 15.3 s), they are judged by their age:
    # 0.7 s old at 16 s, still the refused frames' news; 2.7 s old at 18 s, stale_frames (it used to
    # say "ahead by 5 s" about stamps then in the past).
    with pytest.raises(FrameMatchError) as e:
        store.match(16_000 * MS)
    assert e.value.status == "bad_stamp" and "that stamp is now 0.700 s old" in str(e.value), str(e.value)
    with pytest.raises(FrameMatchError) as e:
        store.match(18_000 * MS)
    assert e.value.status == "stale_frames", str(e.value)
    assert ("CAM_FRONT: its newest frame was stamped 5.000 s ahead of the node's clock and refused on arrival; "
            "that stamp is now 2.700 s old") in str(e.value)


def test_a_little_ahead_is_tolerated_and_ages_normally():
    clock = Clock(10_000 * MS)
    store = FrameStore(CAMERAS, SKEW, AGE, max_future_ns=500 * MS, clock_ns=clock)
    add_set(store, clock.t + 300 * MS)                        # a camera clock 0.3 s ahead of ours
    assert sum(store.bad_stamp.values()) == 0
    assert store.match(clock.t).frames["CAM_FRONT"].stamp_ns == clock.t + 300 * MS
    with pytest.raises(FrameMatchError) as e:                  # it still goes stale, 0.3 s later
        store.match(clock.t + 300 * MS + AGE + 100 * MS)
    assert e.value.status == "stale_frames"


def test_one_camera_ahead_for_two_seconds_is_served_again_at_its_first_good_frame():
    # The issue: CAM_BACK stamped +5 s for 2 s was then blind ~3 s more, its correct frames
    # dropped as older than the (future) history it held.
    clock = Clock(20_000 * MS)
    store = FrameStore(CAMERAS, SKEW, AGE, max_future_ns=500 * MS, clock_ns=clock)
    t = clock.t
    while t < 22_000 * MS:                                     # 12 Hz, CAM_BACK +5 s
        clock.t = t
        add_set(store, t, offsets={c: 5000 if c == "CAM_BACK" else 0 for c in CAMERAS})
        t += 83 * MS
    with pytest.raises(FrameMatchError) as e:
        store.match(t)
    assert e.value.status == "bad_stamp" and "CAM_BACK" in str(e.value) and "CAM_FRONT" not in str(e.value)
    clock.t = t
    add_set(store, t, offsets={c: 0 for c in CAMERAS})         # the first correctly stamped set
    fs = store.match(t + 10 * MS)
    assert fs.frames["CAM_BACK"].stamp_ns == t and fs.skew_ns == 0


def test_node_clock_stepping_back_discards_the_history_at_once():
    # An NTP step (or a restarted simulation clock) moves the node and the cameras back 3 s:
    # the held frames now lie 3 s in the future; they are not matched, and the first frame on
    # the new timeline replaces them.
    clock = Clock(50_000 * MS)
    store = FrameStore(CAMERAS, SKEW, AGE, max_future_ns=500 * MS, clock_ns=clock)
    for k in range(8):
        clock.t = 50_000 * MS + k * 100 * MS
        add_set(store, clock.t, offsets={c: 0 for c in CAMERAS})
    clock.t = 47_000 * MS
    with pytest.raises(FrameMatchError) as e:                  # before any new frame: not served
        store.match(clock.t)
    assert e.value.status == "bad_stamp" and "CAM_BACK 3.000 s" in str(e.value)    # its oldest frame, 3 s ahead
    add_set(store, clock.t, offsets={c: 0 for c in CAMERAS})
    assert store.history_resets == {c: 1 for c in CAMERAS} and store.depth() == {c: 1 for c in CAMERAS}
    assert store.match(clock.t + 20 * MS).frames["CAM_FRONT"].stamp_ns == 47_000 * MS


def test_camera_clock_stepping_back_restarts_its_history_but_a_straggler_does_not():
    store = FrameStore(["A"], SKEW, AGE, history=4, clock_ns=Clock(10_000 * MS))
    for t in (9_600, 9_700, 9_800, 9_900):
        store.add(Frame("A", t * MS, t))
    store.add(Frame("A", 9_000 * MS, "straggler"))             # one late frame, older than the history
    assert store.dropped["A"] == 1 and store.history_resets["A"] == 0
    assert [f.payload for f in store._frames["A"]] == [9_600, 9_700, 9_800, 9_900]
    store.add(Frame("A", 10_000 * MS, 10_000))                 # normal again: the straggler count restarts
    store.add(Frame("A", 9_300 * MS, "stepped"))               # the camera's clock steps back 0.7 s ...
    store.add(Frame("A", 9_383 * MS, "stepped+1"))             # ... and stays there: a new history
    assert store.history_resets["A"] == 1
    assert [f.payload for f in store._frames["A"]] == ["stepped", "stepped+1"]
    assert store.match(10_090 * MS).frames["A"].payload == "stepped+1"
    store.add(Frame("A", 9_466 * MS, "stepped+2"))             # and carries on from there
    assert [f.payload for f in store._frames["A"]][-1] == "stepped+2"


def test_memory_bound_per_camera_drops_the_oldest_and_refuses_a_frame_too_large_alone():
    """frame_memory_mb: each camera's frames take at most max_bytes by their payloads' sizes."""
    clock = Clock(10_000 * MS)
    store = FrameStore(["A", "B"], SKEW, AGE, history=8, clock_ns=clock, max_bytes=250)
    for k, t in enumerate((9_700, 9_800, 9_900)):
        store.add(Frame("A", t * MS, bytes([k]) * 100))
    assert store.depth()["A"] == 2 and store.held_bytes() == {"A": 200, "B": 0}
    assert store.memory_evictions["A"] == 1 and [f.payload[0] for f in store._frames["A"]] == [1, 2]
    store.add(Frame("A", 9_950 * MS, bytes(251)))               # larger than the bound alone: never stored
    assert store.bad_image["A"] == 1 and store.depth()["A"] == 2 and store.held_bytes()["A"] == 200
    # A camera whose only frames were too large: the query is bad_image naming the setting.
    store.add(Frame("B", 9_950 * MS, bytes(300)))
    with pytest.raises(FrameMatchError) as e:
        store.match(10_000 * MS)
    assert e.value.status == "bad_image" and str(e.value) == (
        "B: frame data of 0.0 MB, above frame_memory_mb (0.00025 MB held per camera at most); "
        "refused on arrival, not stored")
    # A late straggler held aside (the clock-step detection) counts too, and goes first.
    store.add(Frame("A", 9_000 * MS, bytes(100)))
    assert store.held_bytes()["A"] == 200 and store.memory_evictions["A"] == 2


def test_memory_bound_comes_from_the_setting():
    from litevlm_runtime.serving.server import QueryServer, ServerSettings

    server = QueryServer(ServerSettings(frame_memory_mb=1.5), lambda rec: None)
    assert server.frames.max_bytes == 1_500_000
    assert QueryServer(ServerSettings(), lambda rec: None).frames.max_bytes == 256_000_000


# ---- the window: a question stamped seconds back, or taken seconds late from a flood ----
def streamed(store, clock, seconds: float, hz: float = 5.0, start_ns: int = 100_000 * MS) -> int:
    """Six cameras at `hz` for `seconds` (nuScenes-like 8 ms spread), the clock following; the last stamp."""
    t = start_ns
    while t < start_ns + int(seconds * 1e9):
        clock.t = t + 40 * MS
        add_set(store, t)
        t += int(1e9 / hz)
    return t - int(1e9 / hz)


def test_a_question_stamped_seconds_back_is_answered_from_the_frames_at_or_before_its_stamp():
    """Six cameras at 5 Hz: questions stamped 2 s and 3 s back get the newest set at or before their
    stamps (with 8 frames held, 1.6 s, they got no_frames naming every camera); one stamped 10 s back,
    before every frame held, gets too_old naming its age and the window, never no_frames."""
    clock = Clock(0)
    store = FrameStore(CAMERAS, SKEW, AGE, clock_ns=clock, window_ns=5000 * MS)
    last = streamed(store, clock, 12.0)
    now = clock.t
    for back_ms in (2000, 3000, 4900):
        stamp = now - back_ms * MS
        fs = store.match(now, as_of_ns=stamp)
        # the set's anchor: the newest frame set started at or before the stamp (sets every 200 ms)
        anchor = last - ((last - stamp + 199 * MS) // (200 * MS)) * 200 * MS
        assert {c: f.stamp_ns for c, f in fs.frames.items()} == {
            c: anchor + i * 8 * MS for i, c in enumerate(CAMERAS)}, back_ms
    with pytest.raises(FrameMatchError) as e:
        store.match(now, as_of_ns=now - 10_000 * MS)
    assert e.value.status == "too_old", str(e.value)
    assert "stamped 10.000 s ago" in str(e.value) and "frame_window_s 5" in str(e.value)
    assert "every camera holds frames from 5.0" in str(e.value)
    assert store.window_evictions["CAM_FRONT"] > 0 and store.held_window_ns()["CAM_FRONT"] >= 5000 * MS


def test_the_window_is_bounded_by_memory_and_says_so():
    """With frame_memory_mb too small for the window, the oldest frames go first: a question
    stamped before what is left is too_old, naming frame_memory_mb."""
    clock = Clock(0)
    store = FrameStore(CAMERAS, SKEW, AGE, clock_ns=clock, window_ns=5000 * MS, max_bytes=100)
    t = 100_000 * MS
    for k in range(30):                                    # 6 s at 5 Hz, 20-byte frames: 5 held per camera
        clock.t = t + 40 * MS
        for i, cam in enumerate(CAMERAS):
            store.add(Frame(cam, t + i * 8 * MS, bytes(20)))
        t += 200 * MS
    assert store.depth()["CAM_FRONT"] == 5 and store.memory_evictions["CAM_FRONT"] > 0
    assert store.match(clock.t, as_of_ns=clock.t - 500 * MS).frames       # inside what is held
    with pytest.raises(FrameMatchError) as e:
        store.match(clock.t, as_of_ns=clock.t - 2000 * MS)
    assert e.value.status == "too_old" and "frame_memory_mb 0.0001" in str(e.value), str(e.value)


def test_a_question_stamped_before_the_first_frame_is_too_old_not_no_frames():
    clock = Clock(0)
    store = FrameStore(CAMERAS, SKEW, AGE, clock_ns=clock)
    streamed(store, clock, 1.0)
    with pytest.raises(FrameMatchError) as e:
        store.match(clock.t, as_of_ns=clock.t - 3000 * MS)
    assert e.value.status == "too_old" and "every camera sent its first frame" in str(e.value), str(e.value)


def test_a_refused_newest_frame_is_named_when_an_older_one_serves():
    """A camera's newest arrival refused (too large) while its previous frame is still fresh: the
    set is matched from that frame and names the refusal (the server puts it in the answer's
    `degraded`); it used to be answered ok with no word of it."""
    clock = Clock(10_000 * MS)
    store = FrameStore(CAMERAS, SKEW, AGE, clock_ns=clock)
    add_set(store, 9_900 * MS)
    store.refuse("CAM_BACK", "CAM_BACK: image 8000x8000 above images.max_pixels; refused on arrival")
    fs = store.match(10_000 * MS)
    assert fs.frames["CAM_BACK"].stamp_ns == 9_900 * MS + 3 * 8 * MS
    assert fs.refused == {"CAM_BACK": "CAM_BACK: image 8000x8000 above images.max_pixels; refused on arrival"}
    add_set(store, 10_000 * MS)                               # a good frame since: the refusal is old news
    assert store.match(10_100 * MS).refused == {}


def test_counters_continue_across_a_rebuilt_store():
    """A configure rebuilds the store; the node's counters run since it started (issue 42: the
    summary read `24 answered; frames 0 received`)."""
    from litevlm_runtime.serving.server import QueryServer, ServerSettings

    server = QueryServer(ServerSettings(), lambda rec: None)
    add_set(server.frames, 1000 * MS)
    server.apply_settings(ServerSettings(frame_window_s=2.0))
    assert server.frames.received == {c: 1 for c in CAMERAS} and server.frames.window_ns == 2000 * MS
