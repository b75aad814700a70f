"""Frame store: keeps each camera's frames of the last few seconds and matches a query to a frame set.

Plain Python (no ROS import) so that the node, `litevlm bag eval` and the unit tests share it.

Matching rule (DESIGN.md section 5): the newest complete set of one frame per camera whose
stamps lie within `max_skew_ns` of each other, every frame younger than `max_age_ns` at the
time the query arrives; with `as_of_ns` (frame_match as_asked) at or before the query's stamp, ages
taken at the stamp. A query that cannot be matched gets a `FrameMatchError` whose status says why
(never silence):
  bad_stamp     some camera delivers, but its frames are stamped ahead of the node's clock by
                more than max_future_ns, so none of them can be used (checked first: it is the
                specific diagnosis behind what would otherwise look like no_frames/stale_frames);
                once those stamps are no longer ahead they are judged by their age (stale_frames)
  bad_image     a camera's frames were refused on arrival (too large) and it has no usable one
  no_frames     some camera has never delivered a frame
  too_old       (as_asked) the query's stamp is older than every frame held of a camera that
                streams: the frames it asked about have left the window (or came before the first
                frame); the message names the query's age and the window held
  stale_frames  some camera's newest frame is older than max_age (camera stopped, or bag gap)
  out_of_sync   every camera is fresh, but no set of frames fits within max_skew

The window. A query is matched when the executor takes it from DDS, which under a flood (or for a
question stamped in the past) is seconds after its stamp: so each camera keeps the frames of the
last `window_ns` of its own stamps (frame_window_s; the newest frame at or before the window's
start too, the one a question stamped there is answered from), bounded by `max_bytes` per camera
(frame_memory_mb) and, if set, by `history` frames. A matched query holds its FrameSet (the frames
are pinned by the query, whatever the store drops later), so the set a query gets is the set of its
stamp, whenever it is served. It used to be the last 8 frames (1.6 s at 5 Hz): a question stamped
2 s before it was taken got no_frames naming every camera while all six streamed.

Clock faults. Stamps are the camera's clock, ages are the node's (`clock_ns`):
  - a frame stamped more than max_future_ns ahead of the node's clock is refused on arrival and
    counted in `bad_stamp` (a frame from the future would have a negative age and never go
    stale); within the tolerance it is kept (clocks of two computers differ by a little);
  - stamps that jump back: a frame older than the newest held one is inserted in stamp order
    (late delivery). When the held frames are by then too far ahead of the node's clock (the
    node's clock stepped back), they are discarded at once. When two frames in a row are older
    than the whole held history (a camera clock that stepped back, not one late straggler, which
    is kept if inside the window, else dropped), the history restarts from them. Both count in
    `history_resets`;
  - a held frame that is ahead of the node's clock by more than the tolerance when a query
    arrives (the node's clock stepped back) is not matched.

Frame sets over time (a query's `frames` K > 1, issue 45). Past set i (t-i, i = 1 .. K - 1) is
matched after the key set (the set above, t-0): the complete set within max_skew whose newest frame
is nearest to the key set's newest stamp minus i x stride (temporal.stride_s), within a quarter of
the stride (PAST_TOLERANCE; the loader's rule for files, frames.py), every frame of it at or before
the node's clock plus max_future. Its stamps alone decide it (as_asked stays deterministic), and the
tolerance keeps two steps from ever taking one set. A step that cannot be matched is a
FrameMatchError naming the camera and the step ("frame set t-2 ..."), with the status of why:
too_old (the window no longer holds that time: frame_window_s, frame_memory_mb), no_frames (the
camera's first frame came after it), stale_frames (a gap in the camera's frames around it),
out_of_sync (every camera has frames there, no set of them fits max_skew). The window must reach
back that far: check_window (settings.py) refuses a frame_window_s below temporal.max_frames x
temporal.stride_s.

New frame sets (`sets_after`): the complete sets, in stamp order, whose newest frame is after a
stamp, each final (every camera has sent a frame stamped at or after it, so no frame of it is still
in flight): what the query server prefetches while idle and offers to standing questions.

Memory: each camera's held frames take at most `max_bytes` (the frame_memory_mb setting) by their
payloads' sizes (payload_bytes), whatever the cameras send: a new frame makes room by dropping
the camera's oldest frames (counted in `memory_evictions`; the window then reaches less far back),
and a frame larger than `max_bytes` alone is refused (`refuse`: the query gets bad_image naming the
camera and the setting). A camera whose newest arrival was refused (too large, or stamped ahead) but
which still has an older usable frame is answered from it, and the FrameSet names the refusal
(`refused`): the server adds it to the answer's `degraded` when the answer used that camera.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class Frame:
    camera: str
    stamp_ns: int          # header stamp: capture time on the camera's clock
    payload: Any           # undecoded image (see ros/images.py); decoded only when a query uses it


@dataclass(frozen=True)
class FrameSet:
    frames: dict[str, Frame]   # camera -> frame, one per camera
    # camera -> why its newest arrival was refused (too large, stamped ahead) although an older frame
    # of it was matched: said in the answer of a query that uses the camera (server.py)
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def newest_ns(self) -> int:
        return max(f.stamp_ns for f in self.frames.values())

    @property
    def skew_ns(self) -> int:
        stamps = [f.stamp_ns for f in self.frames.values()]
        return max(stamps) - min(stamps)


def payload_bytes(payload) -> int:
    """The memory a frame's payload holds: its image bytes (serving/images.py's payloads carry them
    in .data; a bare bytes payload is its own length; anything else counts as nothing)."""
    data = getattr(payload, "data", payload)
    return len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0


def over_memory(camera: str, size: int, max_bytes: int | None) -> str | None:
    """Why a frame of `size` bytes can never be held within the per-camera bound (None: it can)."""
    if max_bytes is None or size <= max_bytes:
        return None
    return (f"{camera}: frame data of {size / 1e6:.1f} MB, above frame_memory_mb ({max_bytes / 1e6:g} MB held per "
            f"camera at most); refused on arrival, not stored")


@dataclass(frozen=True)
class HeldNear:
    """What past_set read under the store's lock for a past set near its target time, per camera: its
    frames `near` it, the (first, last) stamp it `held` (None: nothing), its held stamp `nearest` the
    target, and `ever_held`: whether a frame of it was ever dropped from the front (what _past_error
    tells apart: trimmed, or never received)."""
    near: dict[str, list[Frame]]
    held: dict[str, tuple[int, int] | None]
    nearest: dict[str, int | None]
    ever_held: dict[str, bool]


class FrameMatchError(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


# Frames in a row older than a camera's whole history before it is taken for a clock that
# stepped back (one such frame is a late straggler).
STEPS_BACK_TO_RESET = 2
DEFAULT_WINDOW_NS = 5_000_000_000
# A past frame set is matched within this fraction of the stride of its time (frames.py's loader
# takes the same quarter): consecutive steps' ranges never overlap.
PAST_TOLERANCE = 0.25


class FrameStore:
    """Thread-safe: cameras are added from executor callbacks, matched from query callbacks."""

    def __init__(self, cameras: Sequence[str], max_skew_ns: int, max_age_ns: int, history: int = 0,
                 max_future_ns: int = 500_000_000, clock_ns: Callable[[], int] = time.time_ns,
                 max_bytes: int | None = None, window_ns: int = DEFAULT_WINDOW_NS):
        if (max_skew_ns < 0 or max_age_ns <= 0 or history < 0 or max_future_ns < 0 or (max_bytes or 1) < 1
                or window_ns < 0):
            raise ValueError("max_skew_ns >= 0, max_age_ns > 0, history >= 0, max_future_ns >= 0, window_ns >= 0 "
                             "and max_bytes >= 1 (or None) are required")
        self.cameras = tuple(cameras)
        self.max_bytes = max_bytes             # per camera; None: only the window (and history) bound it
        self.history = int(history)            # frames per camera at most; 0: no count limit
        self.window_ns = int(window_ns)        # how far back (camera stamps) each camera's frames reach
        self.max_skew_ns = int(max_skew_ns)
        self.max_age_ns = int(max_age_ns)
        self.max_future_ns = int(max_future_ns)
        self.clock_ns = clock_ns
        # Per camera, frames in stamp order (and their stamps, for bisect); old ones leave the front.
        self._frames: dict[str, list[Frame]] = {c: [] for c in self.cameras}
        self._stamps: dict[str, list[int]] = {c: [] for c in self.cameras}
        self._lock = threading.Lock()
        self.received = {c: 0 for c in self.cameras}
        self.out_of_order = {c: 0 for c in self.cameras}   # arrived with a stamp older than one held
        self.dropped = {c: 0 for c in self.cameras}        # discarded on arrival (duplicate, too old)
        self.bad_stamp = {c: 0 for c in self.cameras}      # refused: stamped too far ahead of the node's clock
        self.history_resets = {c: 0 for c in self.cameras} # stamps jumped back: held frames discarded
        self._behind: dict[str, list[Frame]] = {c: [] for c in self.cameras}   # in a row, older than the history
        # Per camera, in arrival order (a sequence number: clocks tie): the last frame accepted, and
        # the last one refused for its stamp (seq, arrival on the node's clock, how far ahead): a query
        # names a refusal only while it is the news (it came after the last accepted frame).
        self._seq = 0
        self._accepted_seq = {c: -1 for c in self.cameras}
        self._refused: dict[str, tuple[int, int, int] | None] = {c: None for c in self.cameras}
        # Frames refused on arrival by their header (too large for images.max_pixels ...): counted,
        # and the last one's reason (seq, why) names the camera in a bad_image answer.
        self.bad_image = {c: 0 for c in self.cameras}
        self._refused_image: dict[str, tuple[int, str] | None] = {c: None for c in self.cameras}
        self.memory_evictions = {c: 0 for c in self.cameras}   # held frames dropped to stay within max_bytes
        self.window_evictions = {c: 0 for c in self.cameras}   # held frames that left the time window
        self.ever_held = {c: False for c in self.cameras}       # a frame of it was ever dropped from the front

    COUNTERS = ("received", "out_of_order", "dropped", "bad_stamp", "history_resets", "bad_image",
                "memory_evictions", "window_evictions")

    def carry_counters(self, old: "FrameStore") -> None:
        """Continue `old`'s per-camera counters (a configure rebuilds the store; the node's counters
        run since it started: ros/diagnostics.py)."""
        for name in self.COUNTERS:
            mine, theirs = getattr(self, name), getattr(old, name)
            for c in self.cameras:
                mine[c] += theirs.get(c, 0)

    def refuse(self, camera: str, why: str, now_ns: int | None = None) -> None:
        """A frame of `camera` refused before it was stored (`why` names the camera and the
        defect): a query that then finds no usable frame of that camera is answered bad_image, and
        one answered from an older frame of it says so (FrameSet.refused)."""
        with self._lock:
            self._seq += 1
            self.received[camera] += 1
            self.bad_image[camera] += 1
            self._refused_image[camera] = (self._seq, why)

    def add(self, frame: Frame, now_ns: int | None = None) -> None:
        if frame.camera not in self._frames:
            raise KeyError(f"unknown camera {frame.camera!r}; known: {', '.join(self.cameras)}")
        now = self.clock_ns() if now_ns is None else now_ns
        cam = frame.camera
        refused = over_memory(cam, payload_bytes(frame.payload), self.max_bytes)
        if refused:
            self.refuse(cam, refused, now)
            return
        with self._lock:
            self._insert(frame, now)
            self._trim(cam)
            self._fit(cam)

    # ---- what a camera holds ----
    def _set(self, cam: str, frames: list[Frame]) -> None:
        self._frames[cam] = frames
        self._stamps[cam] = [f.stamp_ns for f in frames]

    def _drop_front(self, cam: str, n: int) -> None:
        if n > 0:
            del self._frames[cam][:n]
            del self._stamps[cam][:n]
            self.ever_held[cam] = True

    def _aside(self, cam: str) -> list[Frame]:
        """Late stragglers held in _behind only (one, at most), not in the history."""
        return [f for f in self._behind[cam] if all(f is not g for g in self._frames[cam])]

    def _held(self, cam: str) -> int:
        """The bytes `cam`'s frames take: its history plus a straggler held aside."""
        return sum(payload_bytes(f.payload) for f in (*self._frames[cam], *self._aside(cam)))

    def _trim(self, cam: str) -> None:
        """The time window (and the count limit): the frames stamped within window_ns of the
        camera's newest, and the newest one at or before the window's start."""
        stamps = self._stamps[cam]
        if not stamps:
            return
        first_kept = max(0, bisect.bisect_right(stamps, stamps[-1] - self.window_ns) - 1)
        self.window_evictions[cam] += first_kept
        self._drop_front(cam, first_kept)
        if self.history and len(self._frames[cam]) > self.history:
            self._drop_front(cam, len(self._frames[cam]) - self.history)

    def _fit(self, cam: str) -> None:
        """Drop `cam`'s oldest frames (a straggler held aside first) until they take at most
        max_bytes; any one frame fits alone (add refused it otherwise)."""
        if self.max_bytes is None:
            return
        held = self._held(cam)
        while held > self.max_bytes and (self._aside(cam) or len(self._frames[cam]) > 1):
            aside = self._aside(cam)
            dropped = aside[0] if aside else self._frames[cam][0]
            if not aside:
                self._drop_front(cam, 1)
            self._behind[cam] = [f for f in self._behind[cam] if f is not dropped]
            held -= payload_bytes(dropped.payload)
            self.memory_evictions[cam] += 1

    def held_bytes(self) -> dict[str, int]:
        """Per camera, the bytes its frames take now (what max_bytes bounds)."""
        with self._lock:
            return {c: self._held(c) for c in self.cameras}

    def held_window_ns(self) -> dict[str, int]:
        """Per camera, the stamps its held frames span (newest - oldest; 0 with one or none)."""
        with self._lock:
            return {c: (s[-1] - s[0]) if s else 0 for c, s in self._stamps.items()}

    def _insert(self, frame: Frame, now: int) -> None:
        """`add`'s clock and order rules (the module's docstring), under the lock."""
        cam = frame.camera
        frames = self._frames[cam]
        self.received[cam] += 1
        ahead = frame.stamp_ns - now
        self._seq += 1
        if ahead > self.max_future_ns:
            self.bad_stamp[cam] += 1
            self._refused[cam] = (self._seq, now, ahead)
            return
        self._accepted_seq[cam] = self._seq
        if not frames or frame.stamp_ns > frames[-1].stamp_ns:
            self._behind[cam].clear()
            frames.append(frame)
            self._stamps[cam].append(frame.stamp_ns)
        elif frame.stamp_ns == frames[-1].stamp_ns:
            self._behind[cam].clear()
            self.dropped[cam] += 1
            frames[-1] = frame   # same stamp again: the newer message wins
        elif frames[-1].stamp_ns - now > self.max_future_ns:
            # Held frames are now too far ahead of the node's clock (it stepped back since
            # they came): they can never be matched; start again from this one.
            self.history_resets[cam] += 1
            self._behind[cam].clear()
            kept = [f for f in frames if f.stamp_ns - now <= self.max_future_ns and f.stamp_ns < frame.stamp_ns]
            self._set(cam, [*kept, frame])
        elif frame.stamp_ns < frames[0].stamp_ns:
            behind = self._behind[cam]
            behind.append(frame)
            if len(behind) >= STEPS_BACK_TO_RESET:
                # Frames keep coming from before the history: the camera's clock stepped back.
                self.history_resets[cam] += 1
                self._set(cam, sorted(behind, key=lambda f: f.stamp_ns))
                behind.clear()
            elif frame.stamp_ns >= frames[-1].stamp_ns - self.window_ns and (not self.history
                                                                            or len(frames) < self.history):
                self.out_of_order[cam] += 1
                self._set(cam, [frame, *frames])
            else:
                self.out_of_order[cam] += 1
                self.dropped[cam] += 1     # a late straggler older than the whole window: useless
        else:
            # Late delivery within the history: insert in stamp order so matching sees it.
            self._behind[cam].clear()
            self.out_of_order[cam] += 1
            at = bisect.bisect_right(self._stamps[cam], frame.stamp_ns)
            frames.insert(at, frame)
            self._stamps[cam].insert(at, frame.stamp_ns)

    # ---- matching ----
    def _refusal(self, cam: str, now_ns: int) -> tuple[str, str, str] | None:
        """(status, short text, sentence) of `cam`'s refusal since its last accepted frame, if any:
        bad_stamp while the refused stamps are still ahead of the clock; once they are not, judged
        by their age (stale_frames when older than max_age); bad_image for a frame refused by its
        size. The sentence is what an answer from an older frame of the camera says."""
        refused = self._refused[cam]
        if refused is not None and refused[0] > self._accepted_seq[cam]:
            _, arrived, ahead = refused
            stamp = arrived + ahead
            was = (f"{cam}: its newest frame was stamped {ahead / 1e9:.3f} s ahead of the node's clock and refused "
                   f"on arrival")
            if stamp - now_ns > self.max_future_ns:
                return "bad_stamp", f"{cam} {ahead / 1e9:.3f} s", was
            age = now_ns - stamp
            if age > self.max_age_ns:
                return "stale_frames", f"{was}; that stamp is now {age / 1e9:.3f} s old", was
            return "bad_stamp", f"{was} (that stamp is now {max(age, 0) / 1e9:.3f} s old)", was
        image = self._refused_image[cam]
        if image is not None and image[0] > self._accepted_seq[cam]:
            return "bad_image", image[1], image[1]
        return None

    def complete(self, as_of_ns: int) -> bool:
        """Whether every camera has delivered a frame stamped at or after `as_of_ns` (the query's
        stamp): frames arrive in stamp order per camera, so no frame stamped before it is still in
        flight, and a match as of it is final."""
        with self._lock:
            return all(self._stamps[c] and self._stamps[c][-1] >= as_of_ns for c in self.cameras)

    def match(self, now_ns: int, as_of_ns: int | None = None) -> FrameSet:
        """The newest complete set at `now_ns` (the node's clock: frame ages, frames from the
        future); with `as_of_ns` (the query's stamp; frame_match as_asked) the newest complete set
        of frames stamped at or before it, ages taken there: the set is then a function of the
        stamps alone, whenever the frames arrived (a stamp ahead of the node's clock by more than
        max_future counts as the clock's)."""
        future = now_ns + self.max_future_ns                  # frames from further ahead are never matched
        ref = now_ns if as_of_ns is None else min(as_of_ns, future)
        hi = future if as_of_ns is None else ref
        with self._lock:
            usable, fresh, oldest, ahead = {}, {}, {}, {}
            for c in self.cameras:
                frames, stamps = self._frames[c], self._stamps[c]
                top = bisect.bisect_right(stamps, hi)
                usable[c] = frames[top - 1] if top else None          # the newest usable frame
                fresh[c] = frames[bisect.bisect_left(stamps, ref - self.max_age_ns, 0, top):top]
                oldest[c] = stamps[0] if stamps else None
                if stamps and stamps[0] > future:                      # all held are ahead of a clock that stepped back
                    ahead[c] = stamps[0] - now_ns
            refusals = {c: self._refusal(c, now_ns) for c in self.cameras}
            ever_held = dict(self.ever_held)
        unserved = [c for c in self.cameras if not fresh[c]]
        kind = {c: refusals[c][0] if refusals[c] else "" for c in self.cameras}
        # bad_stamp first: the specific diagnosis of a camera with nothing usable
        bad = [refusals[c][1] if kind[c] == "bad_stamp" else f"{c} {ahead[c] / 1e9:.3f} s" for c in unserved
               if kind[c] == "bad_stamp" or (c in ahead and not kind[c])]
        if bad:
            raise FrameMatchError(
                "bad_stamp", f"frames stamped ahead of the node's clock by more than max_future "
                             f"{self.max_future_ns / 1e9:.3f} s: {', '.join(bad)}")
        bad_images = [refusals[c][1] for c in unserved if kind[c] == "bad_image"]
        if bad_images:
            raise FrameMatchError("bad_image", "; ".join(bad_images))
        missing = [c for c in unserved if oldest[c] is None and not kind[c]]
        if missing:
            when = "" if as_of_ns is None else " stamped at or before the question"
            raise FrameMatchError("no_frames", f"no frame{when} received yet from {', '.join(missing)}")
        before = [c for c in unserved if usable[c] is None and oldest[c] is not None]   # as_asked: all after the stamp
        if before:
            raise FrameMatchError("too_old", self._too_old(before, oldest, ever_held, ref, now_ns))
        if unserved:
            ages = ", ".join(refusals[c][1] if kind[c] == "stale_frames"
                             else f"{c} {(ref - usable[c].stamp_ns) / 1e9:.3f} s" for c in unserved)
            when = "" if as_of_ns is None else " at the question's stamp"
            raise FrameMatchError(
                "stale_frames", f"newest frame older than max_frame_age {self.max_age_ns / 1e9:.3f} s{when}: {ages}"
            )
        chosen = self._newest_set(fresh)
        if chosen is not None:
            return FrameSet(frames=chosen, refused={c: refusals[c][2] for c in self.cameras if refusals[c]})
        newest = {c: fresh[c][-1].stamp_ns for c in self.cameras}
        spread = (max(newest.values()) - min(newest.values())) / 1e6
        laggard = min(newest, key=newest.get)
        raise FrameMatchError(
            "out_of_sync",
            f"no set of {len(self.cameras)} frames within max_skew {self.max_skew_ns / 1e6:.1f} ms "
            f"(newest frames span {spread:.1f} ms; oldest is {laggard})",
        )

    def match_over_time(self, now_ns: int, as_of_ns: int | None, frames: int, stride_ns: int) -> tuple[FrameSet, ...]:
        """The `frames` frame sets of a query, oldest first, the key set (`match`) last; each past
        set by the rule in the module's docstring. FrameMatchError names the camera and the step."""
        key = self.match(now_ns, as_of_ns)
        sets = [key]
        for step in range(1, frames):
            sets.append(self.past_set(now_ns, key, step, stride_ns))
        return tuple(reversed(sets))

    def past_set(self, now_ns: int, key: FrameSet, step: int, stride_ns: int) -> FrameSet:
        """Frame set t-`step`: the complete set whose newest frame is nearest to `key`'s minus
        step x stride, within PAST_TOLERANCE x stride."""
        target = key.newest_ns - step * stride_ns
        tol = int(stride_ns * PAST_TOLERANCE)
        future = now_ns + self.max_future_ns
        lo, hi = target - tol - self.max_skew_ns, min(target + tol, future)
        with self._lock:
            near = {}                    # camera -> its frames that a set near the target can hold
            for c in self.cameras:
                frames, stamps = self._frames[c], self._stamps[c]
                near[c] = frames[bisect.bisect_left(stamps, lo):bisect.bisect_right(stamps, hi)]
            held = {c: (self._stamps[c][0], self._stamps[c][-1]) if self._stamps[c] else None for c in self.cameras}
            nearest = {c: self._nearest(c, target) for c in self.cameras}
            ever_held = dict(self.ever_held)
        anchors = sorted((f for fs in near.values() for f in fs if target - tol <= f.stamp_ns <= hi),
                         key=lambda f: (abs(f.stamp_ns - target), -f.stamp_ns))
        stamps = {c: [f.stamp_ns for f in fs] for c, fs in near.items()}
        for anchor in anchors:
            chosen = {}
            for c in self.cameras:
                i = bisect.bisect_right(stamps[c], anchor.stamp_ns) - 1
                if i < 0 or near[c][i].stamp_ns < anchor.stamp_ns - self.max_skew_ns:
                    break
                chosen[c] = near[c][i]
            else:
                return FrameSet(frames=chosen)
        raise self._past_error(key, step, stride_ns, target, tol, HeldNear(near, held, nearest, ever_held))

    def _nearest(self, cam: str, target: int) -> int | None:
        """The held stamp of `cam` nearest to `target` (under the lock), or None."""
        stamps = self._stamps[cam]
        i = bisect.bisect_left(stamps, target)
        return min(stamps[max(0, i - 1):i + 1], key=lambda s: abs(s - target), default=None)

    def _past_error(self, key: FrameSet, step: int, stride_ns: int, target: int, tol: int,
                    seen: HeldNear) -> FrameMatchError:
        """Why frame set t-`step` could not be matched, naming the cameras and the step."""
        near, held, nearest, ever_held = seen.near, seen.held, seen.nearest, seen.ever_held
        where = (f"frame set t-{step} ({step} x temporal.stride_s {stride_ns / 1e9:g} s = {step * stride_ns / 1e9:g} s "
                 f"before the newest set, within {tol / 1e9:g} s)")
        missing = [c for c in self.cameras if not any(abs(f.stamp_ns - target) <= tol for f in near[c])]
        if not missing:
            return FrameMatchError("out_of_sync", f"{where}: no set of {len(self.cameras)} frames within max_skew "
                                                  f"{self.max_skew_ns / 1e6:.1f} ms near that time")
        gone = [c for c in missing if held[c] is None or held[c][0] > target + tol]     # nothing held that early
        if gone:
            window = f"frame_window_s {self.window_ns / 1e9:g}" + (
                f", frame_memory_mb {self.max_bytes / 1e6:g}" if self.max_bytes is not None else "") + (
                f", frame_history {self.history}" if self.history else "")
            trimmed = [c for c in gone if held[c] is not None and ever_held[c]]
            if trimmed:
                reach = ", ".join(f"{c} from {(held[c][0] - key.newest_ns) / 1e9:+.3f} s" for c in trimmed)
                return FrameMatchError("too_old", f"{where}: the frames held no longer reach back that far ({reach}; "
                                                  f"the window: {window})")
            first = ", ".join(f"{c} (its first frame {(held[c][0] - key.newest_ns) / 1e9:+.3f} s)"
                              if held[c] is not None else c for c in gone)
            if len(gone) == len(self.cameras) and all(held[c] is not None for c in gone):
                first = (f"any camera (their first frames from "
                         f"{(min(held[c][0] for c in gone) - key.newest_ns) / 1e9:+.3f} s)")
            return FrameMatchError("no_frames", f"{where}: no frame that early received from {first}")
        gaps = ", ".join(f"{c} (its nearest {(nearest[c] - key.newest_ns) / 1e9:+.3f} s)" for c in missing)
        return FrameMatchError("stale_frames", f"{where}: no frame near that time from {gaps}")

    def sets_after(self, after_ns: int, now_ns: int, wait_ns: int = 0) -> list[FrameSet]:
        """The complete frame sets whose newest frame is stamped after `after_ns`, in stamp order, each
        final: every camera has sent a frame stamped at or after its newest (frames come in stamp order
        per camera, so none of it is still in flight), or the node's clock is `wait_ns` past it (the
        match_wait_s a query waits for frames in flight); none ahead of the node's clock by more than
        max_future. A set is the one `match(as_of_ns=its newest stamp)` returns: where every camera
        has sent on, the stamps alone decide which sets there are."""
        future = now_ns + self.max_future_ns
        with self._lock:
            frames = {c: self._frames[c][max(0, bisect.bisect_right(self._stamps[c], after_ns - self.max_skew_ns) - 1):]
                      for c in self.cameras}
        if not all(frames.values()):
            return []
        final = max(min(fs[-1].stamp_ns for fs in frames.values()), now_ns - wait_ns if wait_ns else 0)
        last = min(final, future)
        stamps = {c: [f.stamp_ns for f in fs] for c, fs in frames.items()}
        anchors = sorted({f.stamp_ns for fs in frames.values() for f in fs if after_ns < f.stamp_ns <= last})
        out = []
        for anchor in anchors:
            chosen = {}
            for c in self.cameras:
                i = bisect.bisect_right(stamps[c], anchor) - 1
                if i < 0 or frames[c][i].stamp_ns < anchor - self.max_skew_ns:
                    break
                chosen[c] = frames[c][i]
            else:
                out.append(FrameSet(frames=chosen))
        return out

    def _newest_set(self, fresh: dict[str, list[Frame]]) -> dict[str, Frame] | None:
        """Each fresh frame as the newest member of a set, newest first; the first anchor for which
        every camera has a frame within [anchor - skew, anchor] gives the newest set."""
        stamps = {c: [f.stamp_ns for f in fs] for c, fs in fresh.items()}
        anchors = sorted((f for fs in fresh.values() for f in fs), key=lambda f: f.stamp_ns, reverse=True)
        for anchor in anchors:
            chosen = {}
            for c in self.cameras:
                i = bisect.bisect_right(stamps[c], anchor.stamp_ns) - 1     # newest at or before the anchor
                if i < 0 or fresh[c][i].stamp_ns < anchor.stamp_ns - self.max_skew_ns:
                    break
                chosen[c] = fresh[c][i]
            else:
                return chosen
        return None

    def _too_old(self, cameras: list[str], oldest: dict, ever_held: dict, ref: int, now_ns: int) -> str:
        said: dict[str, list[str]] = {}              # what is said -> the cameras it is said of
        for c in cameras:
            span = (now_ns - oldest[c]) / 1e9
            said.setdefault(f"holds frames from {span:.1f} s ago on" if ever_held[c]
                            else f"sent its first frame {span:.1f} s ago", []).append(c)
        parts = [f"{'every camera' if len(cams) == len(self.cameras) else ', '.join(cams)} {what}"
                 for what, cams in said.items()]
        bound = f"frame_window_s {self.window_ns / 1e9:g}" + (
            f", frame_memory_mb {self.max_bytes / 1e6:g}" if self.max_bytes is not None else "") + (
            f", frame_history {self.history}" if self.history else "")
        return (f"the question is stamped {(now_ns - ref) / 1e9:.3f} s ago, before every frame held: "
                f"{'; '.join(parts)} (the window: {bound}); the frames it asked about are gone")

    def depth(self) -> dict[str, int]:
        with self._lock:
            return {c: len(self._frames[c]) for c in self.cameras}
